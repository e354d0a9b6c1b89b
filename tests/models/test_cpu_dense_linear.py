"""Dense linear layers in float32 math (models/layers/cpu_dense_linear.cpp) for CPUs without
bf16 instructions: the kernel against a float64 reference at generic and at the highest rung
without bf16 instructions this CPU runs (forced on a CPU that has them; bf16
weights: the dot tiles of few rows, the panels of more, the GEMM of many over several
packed groups of panels, strided weight rows, bf16 x; float32 weights of any rows, as they
are; either as panels), what it declines; `--dtype auto` holding a
float32 model's dense weights in bf16 (and nothing else), its greedy tokens against
transformers on the same bf16-representable weights, and the decode loop on them bitwise
the layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import KernelSet, probe_isa
from kernels.isa import rungs
from models.layers import cpu_linear
from models.layers.cpu_linear import (
    FLOAT32_GEMM_ROWS,
    PackedWeight,
    dense_linear_kernel,
    linear,
    pack_weight,
)
from models.loader import dense_weight_dtype, load_model
from splitserve import LLM
from tests.integration.greedy import generate_greedy, greedy_reference, random_prompts
from tests.models.linear_check import check
from tests.models.tiny import make_tiny_checkpoint


def dense_isas() -> list[str]:
    """generic and the highest rung without bf16 instructions this CPU runs."""
    own = rungs(probe_isa())
    plain = [r for r in own if r not in ("avx512_bf16", "amx")]
    return sorted({"generic", plain[-1]}, key=own.index)


# The engine takes the kernel only on CPUs without bf16 instructions; the kernel and the
# engine on it are tested on any CPU, at the highest rung below bf16 it runs (forced on bf16
# CPUs: the engine through SPLITSERVE_CPU_ISA).
PLAIN = KernelSet(cpu=True, isa=dense_isas()[-1])


@pytest.fixture(params=dense_isas())
def ops(request):
    module = dense_linear_kernel(KernelSet(cpu=True, isa=request.param))
    assert module is not None, f"the {request.param} build failed"
    return module


ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 15, 16, 17, 33, 200, 383, 767, 768, 775]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), [(64, 7), (13, 5), (576, 97)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bf16_weights_match_float64(ops, rows, k, n, dtype):
    torch.manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k).to(dtype)
    w = torch.randn(n, k).bfloat16()
    bias = torch.randn(n).to(dtype)
    check(ops.dense_linear(x, w, bias), x, w, bias)
    check(ops.dense_linear(x, w, None), x, w, None)


@pytest.mark.parametrize("rows", [1, 4, 5, 15, 16, 40, 383, 767, 768, 775])
@pytest.mark.parametrize(("k", "n"), [(13, 5), (576, 97)], ids=str)
def test_float32_weights_match_float64(ops, rows, k, n):
    torch.manual_seed(rows * 1000 + k + n)
    x, w, bias = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    check(ops.dense_linear(x, w, bias), x, w, bias)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), [(13, 64), (576, 96)], ids=str)
@pytest.mark.parametrize(
    ("w_dtype", "x_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16,) * 2],
    ids=str,
)
def test_weights_as_panels_match_float64(ops, rows, k, n, w_dtype, x_dtype):
    """bf16 panels hold each k's values in the order the ISA's widening reads them."""
    torch.manual_seed(rows * 1000 + k + n)
    x, w, bias = torch.randn(rows, k).to(x_dtype), torch.randn(n, k).to(w_dtype), torch.randn(n)
    panels = ops.pack_weight_panels(w)
    assert panels.dim() == 3 and panels.shape[0] * panels.shape[2] == n
    assert panels.dtype == w_dtype
    check(ops.dense_linear(x, panels, bias), x, w, bias)
    check(ops.dense_linear(x, panels, None), x, w, None)


def test_what_the_panels_decline(ops):
    w = torch.randn(64, 16)
    assert ops.pack_weight_panels(torch.randn(65, 16)) is None  # not a multiple of the width
    assert ops.pack_weight_panels(w.half()) is None
    assert ops.pack_weight_panels(torch.randn(64, 32)[:, ::2]) is None
    panels = ops.pack_weight_panels(w)
    assert ops.dense_linear(torch.randn(3, 16).bfloat16(), panels, None) is None  # float32 only
    bf16_panels = ops.pack_weight_panels(w.bfloat16())
    assert ops.dense_linear(torch.randn(3, 16).half(), bf16_panels, None) is None
    assert ops.dense_linear(torch.randn(3, 15), panels, None) is None
    assert ops.dense_linear(torch.randn(3, 16), panels, torch.randn(63)) is None
    assert ops.dense_linear(torch.randn(0, 16), panels, None).shape == (0, 64)


def test_the_layer_holds_float32_and_bf16_weights_as_panels():
    kernels = KernelSet(cpu=True, isa=dense_isas()[-1])  # no AMX or bf16 kernel
    w, odd = torch.randn(64, 16), torch.randn(65, 16)
    packed = pack_weight(w, kernels)
    assert packed.data.dim() == 3 and not packed.amx
    assert pack_weight(odd, kernels).data.dim() == 2
    packed16 = pack_weight(w.bfloat16(), kernels)
    assert packed16.data.dim() == 3 and packed16.data.dtype == torch.bfloat16
    assert packed16.row_limit is None and pack_weight(odd.bfloat16(), kernels).data.dim() == 2
    x = torch.randn(5, 16)
    torch.testing.assert_close(linear(x, w, None, packed), x @ w.t())
    y = x.bfloat16()  # declined by the panels: F.linear on the weight
    torch.testing.assert_close(linear(y, w.bfloat16(), None, packed), y @ w.bfloat16().t())


def test_float32_weights_take_the_kernel_on_every_isa_and_f_linear_past_its_rows(monkeypatch):
    """AMX builds too (their tile kernel is bf16 only); a set without float32_gemm (Intel
    CPUs) leaves rows from FLOAT32_GEMM_ROWS on to F.linear, here spied on."""
    w = torch.randn(64, 16)
    native = pack_weight(w, KernelSet(cpu=True))
    assert native is not None and not native.amx and native.data.dim() == 3
    packed = pack_weight(w, KernelSet(cpu=True, float32_gemm=False))
    assert packed.max_rows == FLOAT32_GEMM_ROWS
    assert pack_weight(w, KernelSet(cpu=True, float32_gemm=True)).max_rows is None
    calls = []
    monkeypatch.setattr(cpu_linear.F, "linear", lambda *a: calls.append(a[0].shape[0]) or None)
    for rows in (1, FLOAT32_GEMM_ROWS, FLOAT32_GEMM_ROWS + 1):
        linear(torch.randn(rows, 16), w, None, packed)
    assert calls == [FLOAT32_GEMM_ROWS + 1]


@pytest.mark.parametrize("rows", [3, 30, 400])
def test_weight_rows_may_be_strided(ops, rows):
    torch.manual_seed(rows)
    full = torch.randn(40, 100).bfloat16()
    w = full[:, 10:74]  # rows 100 apart
    x = torch.randn(rows, 64)
    check(ops.dense_linear(x, w, None), x, w, None)


# bf16: 4-8 s each, slow (float32 runs the same groups; bf16 GEMM rows are tested above)
@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)], ids=str
)
def test_many_rows_over_several_packed_groups(ops, dtype):
    torch.set_num_threads(2)  # the workers' items too (one_torch_thread puts it back)
    torch.manual_seed(1)
    w = torch.randn(65590, 64).to(dtype)  # past 8 MB of packed float32: three groups
    x, bias = torch.randn(771, 64), torch.randn(65590)
    check(ops.dense_linear(x, w, bias), x, w, bias)


def test_no_rows_and_what_it_declines(ops):
    w = torch.randn(8, 16).bfloat16()
    assert ops.dense_linear(torch.randn(0, 16), w, None).shape == (0, 8)
    assert ops.dense_linear(torch.randn(2, 16).bfloat16(), w.float(), None) is None
    assert ops.dense_linear(torch.randn(2, 16), w.half(), None) is None
    assert ops.dense_linear(torch.randn(2, 16).half(), w, None) is None
    assert ops.dense_linear(torch.randn(2, 2, 16), w, None) is None
    assert ops.dense_linear(torch.randn(2, 15), w, None) is None
    assert ops.dense_linear(torch.randn(2, 16), w, torch.randn(7)) is None
    assert ops.dense_linear(torch.randn(2, 16), w.t().contiguous().t(), None) is None


def test_the_layer_falls_back_to_a_widened_f_linear():
    x, w = torch.randn(3, 16), torch.randn(8, 16).bfloat16()
    torch.testing.assert_close(linear(x, w), x @ w.float().t())
    declines = PackedWeight(dense_linear_kernel(PLAIN), w.half(), amx=False)
    torch.testing.assert_close(linear(x, w, packed=declines), x @ w.float().t())
    w32 = w.float()
    many = torch.randn(400, 16)  # the panels' rows
    taken = PackedWeight(dense_linear_kernel(PLAIN), w32, amx=False)
    torch.testing.assert_close(linear(many, w32, packed=taken), many @ w32.t())


def test_auto_holds_dense_weights_in_bf16_only_where_it_may():
    off = KernelSet()
    assert dense_weight_dtype("auto", torch.float32, "cpu", PLAIN) == torch.bfloat16
    assert dense_weight_dtype("float32", torch.float32, "cpu", PLAIN) == torch.float32
    assert dense_weight_dtype(torch.float32, torch.float32, "cpu", PLAIN) == torch.float32
    assert dense_weight_dtype("auto", torch.bfloat16, "cpu", PLAIN) == torch.bfloat16
    assert dense_weight_dtype("auto", torch.float32, "cpu", off) == torch.float32
    assert dense_weight_dtype("auto", torch.float32, "meta", PLAIN) == torch.float32


def bf16_representable(path: str) -> str:
    """The checkpoint with every matrix rounded to bf16 (kept float32): what `auto` holds."""
    for file in Path(path).glob("*.safetensors"):
        tensors = load_file(file)
        save_file(
            {n: t.bfloat16().float() if t.dim() == 2 else t for n, t in tensors.items()},
            file,
            metadata={"format": "pt"},
        )
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_auto_model_holds_bf16_and_matches_transformers(tmp_path, monkeypatch, tied):
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", PLAIN.isa)
    path = bf16_representable(make_tiny_checkpoint(tmp_path, tie_word_embeddings=tied))
    model = load_model(path, "auto", "cpu", kernels=PLAIN)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert layer.input_layernorm.weight.dtype == torch.float32
    assert model.model.embed_tokens(torch.tensor([1, 2])).dtype == torch.float32
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    llm = LLM(path, dtype="auto", kv_cache_memory=8 << 20, max_model_len=256)
    try:
        reference = greedy_reference(path)
        prompts = random_prompts(4, 3, 150)  # prefills over and under the panels' rows
        for prompt, out in zip(prompts, generate_greedy(llm, prompts), strict=True):
            assert out.outputs[0].token_ids == reference(prompt)
    finally:
        llm.shutdown()


def test_decode_loop_on_bf16_weights_is_the_layers(tmp_path, monkeypatch):
    path = make_tiny_checkpoint(tmp_path, "qwen2")  # qkv bias
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", PLAIN.isa)
    outs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("SPLITSERVE_CPU_DECODE_LOOP", setting)
        llm = LLM(path, dtype="auto", kv_cache_memory=8 << 20, max_model_len=256)
        try:
            model = llm.engine.executor.runner.model.model
            got = generate_greedy(llm, random_prompts(3, 3, 20), logprobs=2)
            assert (model.decode_loop is not None) == (setting == "1")
        finally:
            llm.shutdown()
        outs[setting] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]
    assert outs["1"] == outs["0"]
