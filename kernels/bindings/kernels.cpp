// The Python face of the kernels every model may run (kernels/libraries.py, KERNELS): one
// submodule per kernel file, under the name its Python loads it by. The files themselves
// include no Python (kernels/python_module.h); a file built only on some ISA rungs is bound
// under the same rungs' macros as libraries.py builds it.
#include "torch_ext.h"
#include "python_module.h"
#include "cpu_api.h"
#include "../../models/cpu_decode_loop.h"

#include <memory>
#include <string>
#include <utility>

namespace {

namespace api = splitserve::api;
using splitserve::python::arg;
using splitserve::python::def;
using splitserve::python::Dict;

void bind_attention(PyObject* m) {
  namespace attn = splitserve::attn;
  def<&attn::paged_decode>(m, "paged_decode", "Paged decode attention reading K/V in place",
                           {arg("out"), arg("q"), arg("kv_cache"), arg("block_table"),
                            arg("seq_lens"), arg("reqs"), arg("rows"), arg("scale"),
                            arg("window"), arg("k_scale") = 1.0, arg("v_scale") = 1.0});
  def<&attn::paged_prefill>(
      m, "paged_prefill",
      "Causal prefill attention over the paged cache; false where it takes none",
      {arg("out"), arg("q"), arg("kv_cache"), arg("block_table"), arg("seq_lens"),
       arg("query_start_loc"), arg("reqs"), arg("scale"), arg("window"), arg("k_scale") = 1.0,
       arg("v_scale") = 1.0});
  def<&attn::has_amx_path>(m, "has_amx_path", "Whether the AMX paths are built and usable");
  def<&attn::store_kv>(m, "store_kv", "Write this step's K/V rows into the paged cache",
                       {arg("k"), arg("v"), arg("kv_cache"), arg("slot_mapping"),
                        arg("k_scale") = 1.0, arg("v_scale") = 1.0});
}

void bind_ops(PyObject* m) {
  namespace ops = splitserve::ops;
  def<&ops::rms_norm>(m, "rms_norm", "weight * norm(x) in a new tensor; None if not taken",
                      {arg("x"), arg("weight"), arg("eps")});
  def<&ops::add_rms_norm>(m, "add_rms_norm",
                          "sum = x + residual; out = weight * norm(sum); false if not taken",
                          {arg("x"), arg("residual"), arg("weight"), arg("eps"), arg("out"),
                           arg("sum")});
  def<&ops::rotary_embedding>(m, "rotary_embedding",
                              "neox rotary of q and k, in place; false if not taken",
                              {arg("positions"), arg("q"), arg("k"), arg("cos_cache"),
                               arg("sin_cache"), arg("head_dim")});
  def<&ops::silu_and_mul>(m, "silu_and_mul",
                          "silu(gate) * up for x = [gate; up]; None if not taken", {arg("x")});
}

// A dense linear kernel, lent to the decode loop by its c_api() (models/cpu_decode_loop.py).
template <auto Kernel>
void bind_dense_linear(PyObject* m, const char* doc) {
  def<Kernel, true>(m, "dense_linear", doc, {arg("x"), arg("weight"), arg("bias") = std::nullopt});
}

PyObject* dense_c_api() {
  return api::lend({{"dense_linear", "splitserve.dense_linear", &splitserve::dense::dense_linear}});
}

std::unique_ptr<splitserve::decode::DecodeLoop> make_decode_loop(
    Dict linears, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
    double scale, at::Tensor cos_cache, at::Tensor sin_cache) {
  using splitserve::decode::DecodeLoop;
  DecodeLoop::Lent lent;
  PyObject *key, *value;
  for (Py_ssize_t i = 0; PyDict_Next(linears.ptr, &i, &key, &value);) {
    const std::string name = splitserve::python::From<std::string>::convert(key);
    lent[name] = api::borrow_pointer(linears, name);
  }
  return std::make_unique<DecodeLoop>(std::move(lent), num_heads, num_kv_heads, head_dim, eps,
                                      scale, std::move(cos_cache), std::move(sin_cache));
}

void bind_decode_loop(PyObject* m) {
  using splitserve::decode::DecodeLoop;
  using splitserve::python::method;
  splitserve::python::make_class<DecodeLoop>(
      m, "DecodeLoop",
      {method<&DecodeLoop::add_layer>(
           "add_layer", "a layer's weights and kernels",
           {arg("input_norm"), arg("post_norm"), arg("qkv"), arg("o"), arg("gate_up"),
            arg("down"), arg("k_scale"), arg("v_scale"), arg("window")}),
       method<&DecodeLoop::forward, true>(
           "forward", "the layers' decode step: (hidden, residual) before the last norm",
           {arg("hidden"), arg("positions"), arg("kv_caches"), arg("slot_mapping"),
            arg("block_table"), arg("seq_lens"), arg("reqs"), arg("rows")})});
  def<&make_decode_loop>(m, "DecodeLoop", "a decode loop over the layers added to it",
                         {arg("linears"), arg("num_heads"), arg("num_kv_heads"),
                          arg("head_dim"), arg("eps"), arg("scale"), arg("cos_cache"),
                          arg("sin_cache")});
}

#if defined(SPLITSERVE_AVX512_BF16) && !defined(SPLITSERVE_AMX)
PyObject* bf16_c_api() {
  return api::lend({{"bf16_linear", "splitserve.bf16_linear", &splitserve::bf16::dense_linear}});
}
#endif

#if defined(SPLITSERVE_AMX)
PyObject* amx_c_api() {
  return api::lend({{"amx_linear", "splitserve.amx_linear", &splitserve::amx_linear::linear}});
}
#endif

}  // namespace

SPLITSERVE_PYTHON_MODULE(m) {
  using splitserve::python::submodule;
  bind_attention(submodule(m, "attention"));
  bind_ops(submodule(m, "ops"));
  PyObject* dense = submodule(m, "dense_linear");
  bind_dense_linear<&splitserve::dense::dense_linear>(
      dense, "x W^T (+ bias) in float32 math for a bf16 or float32 W; None for tensors it "
             "does not take");
  def<&dense_c_api>(dense, "c_api", "the kernel as a C function pointer, for the decode loop");
  def<&splitserve::dense::pack_weight_panels>(
      dense, "pack_weight_panels",
      "a float32 or bf16 weight [N, K] as panels dense_linear takes in its place; None where N "
      "is not a multiple of the panel width",
      {arg("weight")});
#if defined(SPLITSERVE_AVX512_BF16) && !defined(SPLITSERVE_AMX)
  PyObject* bf16 = submodule(m, "bf16_linear");
  bind_dense_linear<&splitserve::bf16::dense_linear>(
      bf16, "x W^T (+ bias) for bf16 x of at most 64 rows and a bf16 W; None if not taken");
  def<&bf16_c_api>(bf16, "c_api", "the kernel as a C function pointer, for the decode loop");
#endif
#if defined(SPLITSERVE_AMX)
  namespace amx = splitserve::amx_linear;
  PyObject* amx_linear = submodule(m, "amx_linear");
  def<&amx::amx_usable>(amx_linear, "amx_usable", "whether this process may use AMX tiles");
  def<&amx::pack_weight>(amx_linear, "pack_weight",
                         "a bf16 [N, K] weight in the kernel's tile layout; None where it takes "
                         "none",
                         {arg("weight")});
  def<&amx::linear>(amx_linear, "linear",
                    "x W^T (+ bias), W packed by pack_weight; None for other x",
                    {arg("x"), arg("packed"), arg("bias") = std::nullopt});
  static_assert(std::is_same_v<decltype(&amx::linear), api::DenseLinear>);
  def<&amx_c_api>(amx_linear, "c_api", "the kernel as a C function pointer, for the decode loop");
#endif
  def<&splitserve::moe::fused_experts, true>(
      submodule(m, "moe"), "fused_experts",
      "sum_j weight[t, j] * expert ids[t, j]'s SwiGLU MLP of x[t]; None if not taken",
      {arg("x"), arg("w13"), arg("w2"), arg("topk_weights"), arg("topk_ids"),
       arg("chunk_tokens") = 0});
  def<&splitserve::sampler::sample, true>(
      submodule(m, "sampler"), "sample",
      "Greedy / temperature / top-k / top-p / min-p sampling of CPU logits",
      {arg("logits"), arg("temperature"), arg("top_k"), arg("top_p"), arg("min_p"), arg("u"),
       arg("greedy_below")});
  bind_decode_loop(submodule(m, "decode_loop"));
}
