// The Python face of the kernels every model may run (kernels/libraries.py, KERNELS): one
// submodule per kernel file, under the name its Python loads it by. The files themselves
// include no pybind11 (kernels/pybind_ext.h says why); a file built only on some ISA rungs
// is bound under the same rungs' macros as libraries.py builds it.
#include "torch_ext.h"
#include "pybind_ext.h"
#include "cpu_api.h"
#include "../../models/cpu_decode_loop.h"

#include <memory>
#include <string>
#include <utility>

namespace {

namespace api = splitserve::api;
using py::arg;

void bind_attention(py::module_ m) {
  namespace attn = splitserve::attn;
  m.def("paged_decode", &attn::paged_decode, "Paged decode attention reading K/V in place",
        arg("out"), arg("q"), arg("kv_cache"), arg("block_table"), arg("seq_lens"), arg("reqs"),
        arg("rows"), arg("scale"), arg("window"), arg("k_scale") = 1.0, arg("v_scale") = 1.0);
  m.def("paged_prefill", &attn::paged_prefill,
        "Causal prefill attention over the paged cache; false where it takes none", arg("out"),
        arg("q"), arg("kv_cache"), arg("block_table"), arg("seq_lens"), arg("query_start_loc"),
        arg("reqs"), arg("scale"), arg("window"), arg("k_scale") = 1.0, arg("v_scale") = 1.0);
  m.def("has_amx_path", &attn::has_amx_path, "Whether the AMX paths are built and usable");
  m.def("store_kv", &attn::store_kv, "Write this step's K/V rows into the paged cache",
        arg("k"), arg("v"), arg("kv_cache"), arg("slot_mapping"), arg("k_scale") = 1.0,
        arg("v_scale") = 1.0);
}

void bind_ops(py::module_ m) {
  namespace ops = splitserve::ops;
  m.def("rms_norm", &ops::rms_norm, "weight * norm(x) in a new tensor; None if not taken",
        arg("x"), arg("weight"), arg("eps"));
  m.def("add_rms_norm", &ops::add_rms_norm,
        "sum = x + residual; out = weight * norm(sum); false if not taken", arg("x"),
        arg("residual"), arg("weight"), arg("eps"), arg("out"), arg("sum"));
  m.def("rotary_embedding", &ops::rotary_embedding,
        "neox rotary of q and k, in place; false if not taken", arg("positions"), arg("q"),
        arg("k"), arg("cos_cache"), arg("sin_cache"), arg("head_dim"));
  m.def("silu_and_mul", &ops::silu_and_mul,
        "silu(gate) * up for x = [gate; up]; None if not taken", arg("x"));
}

// A dense linear kernel, lent to the decode loop as `name` (models/cpu_decode_loop.py).
void bind_dense_linear(py::module_ m, api::DenseLinear kernel, const char* name,
                       const char* capsule, const char* doc) {
  m.def("dense_linear", kernel, doc, arg("x"), arg("weight"), arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("c_api", [kernel, name, capsule] {
    py::dict lent;
    lent[name] = api::lend(kernel, capsule);
    return lent;
  }, "the kernel as a C function pointer, for the decode loop");
}

void bind_decode_loop(py::module_ m) {
  using splitserve::decode::DecodeLoop;
  py::class_<DecodeLoop>(m, "DecodeLoop", py::module_local())
      .def(py::init([](const py::dict& linears, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, double eps, double scale, at::Tensor cos_cache,
                       at::Tensor sin_cache) {
             DecodeLoop::Lent lent;
             for (const auto& item : linears) {
               const auto name = item.first.cast<std::string>();
               lent[name] = api::borrow_pointer(linears, name);
             }
             return std::make_unique<DecodeLoop>(std::move(lent), num_heads, num_kv_heads,
                                                 head_dim, eps, scale, std::move(cos_cache),
                                                 std::move(sin_cache));
           }),
           arg("linears"), arg("num_heads"), arg("num_kv_heads"), arg("head_dim"), arg("eps"),
           arg("scale"), arg("cos_cache"), arg("sin_cache"))
      .def("add_layer", &DecodeLoop::add_layer, arg("input_norm"), arg("post_norm"), arg("qkv"),
           arg("o"), arg("gate_up"), arg("down"), arg("k_scale"), arg("v_scale"), arg("window"))
      .def("forward", &DecodeLoop::forward, arg("hidden"), arg("positions"), arg("kv_caches"),
           arg("slot_mapping"), arg("block_table"), arg("seq_lens"), arg("reqs"), arg("rows"),
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_attention(m.def_submodule("attention"));
  bind_ops(m.def_submodule("ops"));
  auto dense = m.def_submodule("dense_linear");
  bind_dense_linear(dense, &splitserve::dense::dense_linear, "dense_linear",
                    "splitserve.dense_linear",
                    "x W^T (+ bias) in float32 math for a bf16 or float32 W; None for tensors it "
                    "does not take");
  dense.def("pack_weight_panels", &splitserve::dense::pack_weight_panels,
            "a float32 or bf16 weight [N, K] as panels dense_linear takes in its place; None "
            "where N is not a multiple of the panel width",
            arg("weight"));
#if defined(SPLITSERVE_AVX512_BF16) && !defined(SPLITSERVE_AMX)
  bind_dense_linear(m.def_submodule("bf16_linear"), &splitserve::bf16::dense_linear,
                    "bf16_linear", "splitserve.bf16_linear",
                    "x W^T (+ bias) for bf16 x of at most 64 rows and a bf16 W; None if not "
                    "taken");
#endif
#if defined(SPLITSERVE_AMX)
  namespace amx = splitserve::amx_linear;
  auto amx_linear = m.def_submodule("amx_linear");
  amx_linear.def("amx_usable", &amx::amx_usable, "whether this process may use AMX tiles");
  amx_linear.def("pack_weight", &amx::pack_weight,
                 "a bf16 [N, K] weight in the kernel's tile layout; None where it takes none",
                 arg("weight"));
  amx_linear.def("linear", &amx::linear,
                 "x W^T (+ bias), W packed by pack_weight; None for other x", arg("x"),
                 arg("packed"), arg("bias") = py::none());
  static_assert(std::is_same_v<decltype(&amx::linear), api::DenseLinear>);
  amx_linear.def("c_api", [] {
    py::dict lent;
    lent["amx_linear"] = api::lend(&amx::linear, "splitserve.amx_linear");
    return lent;
  }, "the kernel as a C function pointer, for the decode loop");
#endif
  m.def_submodule("moe").def(
      "fused_experts", &splitserve::moe::fused_experts,
      "sum_j weight[t, j] * expert ids[t, j]'s SwiGLU MLP of x[t]; None if not taken", arg("x"),
      arg("w13"), arg("w2"), arg("topk_weights"), arg("topk_ids"), arg("chunk_tokens") = 0,
      py::call_guard<py::gil_scoped_release>());
  m.def_submodule("sampler").def(
      "sample", &splitserve::sampler::sample,
      "Greedy / temperature / top-k / top-p / min-p sampling of CPU logits",
      py::call_guard<py::gil_scoped_release>());
  bind_decode_loop(m.def_submodule("decode_loop"));
}
