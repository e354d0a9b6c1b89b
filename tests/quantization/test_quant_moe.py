"""Quantized experts (models/quantization/quant_moe.py, cpu_quant_moe.cpp): the C++ kernel
against a float64 reference on the dequantized weights over random routings, for each
format pair (and fp8) and ISA built here; --quantization int8 / fp8 on MoE models and GGUF
MoE files against transformers on the dequantized weights."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import KernelSet
from models.gguf_file import gguf_config
from models.quantization.block_quant import BlockQuantWeight, pack_int4
from models.quantization.cpu_fp8_linear import Fp8Weight, quantize_fp8_per_channel
from models.quantization.fp8 import Fp8MoEMethod
from models.quantization.int8 import quantize_per_channel_int8
from models.quantization.quant_moe import GatheredWeight, quant_moe_kernel
from splitserve import LLM
from tests.integration.greedy import random_prompts
from tests.models.tiny import load_reference
from tests.models.tiny_gguf import DEFAULT_TYPES, EXPERT_FFN, write_tiny_gguf
from tests.models.tiny_gguf import EXPERTS as EXPERTS_GGUF
from tests.models.tiny_gguf import TOP_K as TOP_K_GGUF
from tests.quantization.fp8_checkpoint import write_fp8_checkpoint
from tests.quantization.int_formats import IntFormat
from tests.quantization.int_packers import write_quantized
from tests.quantization.reference import check_greedy, dequantized_reference

HIDDEN, INTER, EXPERTS, TOP_K = 96, 64, 6, 2


def _random_block_quant(n: int, k: int, bits: int, block: int, mins: bool, gen) -> BlockQuantWeight:
    scales = (torch.rand(n, k // block, generator=gen) * 0.02 + 0.005).half()
    if bits == 4:
        q = pack_int4(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8))
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    m = -(torch.rand(n, k // block, generator=gen) * 0.1).half() if mins else None
    return BlockQuantWeight(bits, q, scales, m, block)


# Cases on two worker processes beyond one per kind of shard cutting: `make test-all` runs them.
SLOW = pytest.mark.slow
# (gate, up, down) formats: (bits, block size, mins)
FORMATS = {
    "int8-per-channel": [(8, None, False)] * 3,
    "q4_1": [(4, 32, True)] * 3,
    "gate-up-apart": [(4, 32, True), (8, 32, False), (4, 16, False)],
}


def _experts(formats, gen) -> list[list[BlockQuantWeight]]:
    """[gate, up, down], each a BlockQuantWeight per expert."""
    shapes = [(INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    return [
        [_random_block_quant(n, k, bits, block or k, mins, gen) for _ in range(EXPERTS)]
        for (n, k), (bits, block, mins) in zip(shapes, formats, strict=True)
    ]


def _reference(x, weights, topk_weights, topk_ids) -> torch.Tensor:
    gate, up, down = ([w.dequantize().double() for w in ws] for ws in weights)
    return _reference_dense(x, gate, up, down, topk_weights, topk_ids)


def _reference_dense(x, gate, up, down, topk_weights, topk_ids) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist(), strict=True):
            if e < 0:
                continue
            xt = x[t].double()
            h = torch.nn.functional.silu(gate[e] @ xt) * (up[e] @ xt)
            out[t] += w * (down[e] @ h)
    return out


def _method(weights, kernels):
    """A block-quantized experts method holding `weights`, bound to `kernels`."""
    from models.quantization.int8 import Int8MoEMethod

    method = Int8MoEMethod()
    method.create_weights(_Layer())
    method.stack(_Layer(), *weights)
    method.bind_kernels(_Layer(), kernels)
    return method


class _Layer:
    num_local_experts = EXPERTS
    prefix = "layers.0.mlp.experts"


@pytest.mark.parametrize("exact", [True, False], ids=["float32-products", "int8-activations"])
@pytest.mark.parametrize("formats", list(FORMATS), ids=list(FORMATS))
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_kernel_matches_the_dequantized_reference(isa, formats, tokens, exact):
    gen = torch.Generator().manual_seed(tokens)
    weights = _experts(FORMATS[formats], gen)
    kernels = KernelSet(cpu=True, isa=isa, int8_activations=not exact)
    assert quant_moe_kernel(kernels) is not None, f"the {isa} build failed"
    method = _method(weights, kernels)
    assert method.kernel_experts is not None
    x = torch.randn(tokens, HIDDEN, generator=gen)
    topk_ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    topk_ids[0, 0] = -1  # an expert on another rank; expert 5 never routed below
    topk_ids[topk_ids == EXPERTS - 1] = -1
    topk_weights = torch.rand(tokens, TOP_K, generator=gen)
    out = method.apply(_Layer(), x, topk_weights, topk_ids)
    expected = _reference(x, weights, topk_weights, topk_ids)
    scale = expected.abs().max().item()
    tol = 2e-6 if exact else 2e-2  # int8 activations: ~1/254 per feature, relative
    assert (out.double() - expected).abs().max().item() <= tol * scale + 1e-7
    torch_out = _method(weights, KernelSet()).apply(_Layer(), x, topk_weights, topk_ids)
    assert (torch_out.double() - expected).abs().max().item() <= 2e-6 * scale + 1e-7


@pytest.mark.parametrize("same_index", [True, False], ids=["gate-up-fused", "gate-up-apart"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_gathered_inputs_match_the_reference(isa, same_index, tokens):
    """Gate and up whose input features are x's in a per-expert order (GPTQ act-order):
    the kernel and the torch path gather x by each expert's index (gate and up fused into
    one weight where their indexes agree)."""
    gen = torch.Generator().manual_seed(tokens)
    gate, up, down = _experts(FORMATS["q4_1"], gen)
    index = [[torch.randperm(HIDDEN, generator=gen) for _ in range(EXPERTS)] for _ in "gu"]
    if same_index:
        index[1] = index[0]
    gathered = [
        [GatheredWeight(w, i) for w, i in zip(ws, idx, strict=True)]
        for ws, idx in zip((gate, up), index, strict=True)
    ]
    dense = []
    for ws, idx in zip((gate, up), index, strict=True):
        full = torch.zeros(EXPERTS, INTER, HIDDEN, dtype=torch.float64)
        for e, (w, i) in enumerate(zip(ws, idx, strict=True)):
            full[e][:, i] = w.dequantize().double()
        dense.append(full)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    topk_ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, TOP_K, generator=gen)
    down_dense = torch.stack([w.dequantize().double() for w in down])
    expected = _reference_dense(x, *dense, down_dense, topk_weights, topk_ids)
    scale = expected.abs().max().item()
    for kernels in (KernelSet(cpu=True, isa=isa, int8_activations=False), KernelSet()):
        method = _method([*gathered, down], kernels)
        assert len(method.gate_up) == (1 if same_index else 2)
        assert (method.kernel_experts is not None) == kernels.cpu
        out = method.apply(_Layer(), x, topk_weights, topk_ids)
        assert (out.double() - expected).abs().max().item() <= 2e-6 * scale + 1e-7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_takes_16_bit_activations(dtype):
    gen = torch.Generator().manual_seed(7)
    weights = _experts(FORMATS["q4_1"], gen)
    method = _method(weights, KernelSet(cpu=True))
    x = torch.randn(9, HIDDEN, generator=gen)
    topk_ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(9)])
    topk_weights = torch.rand(9, TOP_K, generator=gen)
    out = method.apply(_Layer(), x.to(dtype), topk_weights, topk_ids)
    assert out.dtype == dtype
    expected = _reference(x.to(dtype).float(), weights, topk_weights, topk_ids)
    assert (out.double() - expected).abs().max().item() <= 3e-2 * expected.abs().max().item()


@pytest.mark.parametrize("tokens", [1, 5, 150])
def test_fp8_kernel_matches_the_dequantized_reference(isa, tokens):
    """Experts with more than EXPERT_KERNEL_ROWS rows take the dequantized matmul."""
    gen = torch.Generator().manual_seed(tokens)
    shapes = [(2 * INTER, HIDDEN), (HIDDEN, INTER)]
    w13, w2 = (
        [quantize_fp8_per_channel(torch.randn(n, k, generator=gen) * 0.1) for _ in range(EXPERTS)]
        for n, k in shapes
    )
    method = Fp8MoEMethod()
    method.create_weights(_Layer())
    gate = [Fp8Weight(w.weight[:INTER], w.scale[:INTER]) for w in w13]
    up = [Fp8Weight(w.weight[INTER:], w.scale[INTER:]) for w in w13]
    method.stack(_Layer(), gate, up, w2)
    method.bind_kernels(_Layer(), KernelSet(cpu=True, isa=isa))
    assert method.kernel_experts is not None, f"the {isa} build failed"
    x = torch.randn(tokens, HIDDEN, generator=gen)
    topk_ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, TOP_K, generator=gen)
    out = method.apply(_Layer(), x, topk_weights, topk_ids)
    dense = [[w.dequantize().double() for w in ws] for ws in (w13, w2)]
    gate = [w[:INTER] for w in dense[0]]
    up = [w[INTER:] for w in dense[0]]
    expected = _reference_dense(x, gate, up, dense[1], topk_weights, topk_ids)
    assert (out.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def _per_channel(quantize):
    """dequantized_reference's function for a per-channel method, experts included."""

    def dequantize(name, w):
        return quantize(w).dequantize()

    return dequantize


@torch.no_grad()
def _quantized_reference(checkpoint, dequantize):
    reference = dequantized_reference(checkpoint, dequantize)
    for name, param in reference.named_parameters():
        if ".experts." in name and param.dim() == 3:  # stacked [E, N, K]: per expert, per row
            param.copy_(torch.stack([dequantize(name, e) for e in param.data]))
    return reference


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.parametrize("checkpoint", ["qwen3-moe", "mixtral"], indirect=True)
def test_int8_experts_greedy_matches_transformers(checkpoint):
    reference = _quantized_reference(checkpoint, _per_channel(quantize_per_channel_int8))
    llm = LLM(checkpoint, dtype="float32", quantization="int8", kv_cache_memory=2**24)
    check_greedy(llm, reference, random_prompts(4, 3, 20))
    llm.shutdown()


@pytest.mark.parametrize("checkpoint", ["qwen3-moe"], indirect=True)
def test_fp8_experts_greedy_matches_transformers(checkpoint):
    reference = _quantized_reference(checkpoint, _per_channel(quantize_fp8_per_channel))
    llm = LLM(checkpoint, dtype="float32", quantization="fp8", kv_cache_memory=2**24)
    check_greedy(llm, reference, random_prompts(4, 3, 20))
    llm.shutdown()


def _gguf_moe_reference(path, expected):
    """transformers' model of the file's config with the expected (gguf-py dequantized)
    weights: its own GGUF reader leaves moe_intermediate_size at the default."""
    from transformers import AutoModelForCausalLM

    config = gguf_config(path)
    assert (config.num_experts, config.num_experts_per_tok) == (EXPERTS_GGUF, TOP_K_GGUF)
    assert config.moe_intermediate_size == EXPERT_FFN
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    model.load_state_dict(expected, strict=True)
    return model.eval()


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_gguf_experts_greedy_matches_transformers(tmp_path, arch):
    path, expected = write_tiny_gguf(tmp_path, arch)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**24)
    assert llm.config.quantization == "gguf"
    check_greedy(llm, _gguf_moe_reference(path, expected), random_prompts(4, 3, 20))
    llm.shutdown()


# Every tensor on 32-element blocks, so that two ranks can split it.
TP2_MOE_TYPES = {n: "Q8_0" for n, t in DEFAULT_TYPES.items() if t.endswith("_K")} | {
    f"blk.{i}.ffn_{p}_exps.weight": t
    for i in range(2)
    for p, t in zip(("gate", "up", "down"), ("Q8_0", "Q4_1", "Q5_0"), strict=True)
}


# Slow, 8-17 s each (GGUF weights on two ranks: test_gguf.py; quantized experts on two ranks:
# the int8 and fp8 checkpoints' tests below)
@SLOW
@pytest.mark.usefixtures("exact_float32")
@pytest.mark.gpus(2)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_gguf_experts_on_two_ranks(tmp_path, expert_parallel):
    path, expected = write_tiny_gguf(tmp_path, "qwen3moe", types=TP2_MOE_TYPES)
    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_memory=2**24,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )
    check_greedy(llm, _gguf_moe_reference(path, expected), random_prompts(4, 3, 20))
    llm.shutdown()


def test_unquantized_gguf_experts_are_refused(tmp_path):
    types = {f"blk.{i}.ffn_down_exps.weight": "F16" for i in range(2)}
    path, _ = write_tiny_gguf(tmp_path, "qwen3moe", types=types)
    with pytest.raises(Exception, match="experts' down weights are unquantized"):
        LLM(str(path), dtype="float32", kv_cache_memory=2**24)


# A quantized module's tensors (its bias stays).
_QUANTIZED = ("weight", "weight_scale", "input_scale", "qweight", "qzeros", "scales", "g_idx")


def _dequantized_folder(src: Path, dst: Path, dequantized: dict[str, torch.Tensor]) -> str:
    """A float32 copy of quantized checkpoint `src`: each quantized module's tensors
    replaced by its dequantized weight, no quantization_config (what transformers computes
    on)."""
    shutil.copytree(src, dst)
    tensors = {
        name: tensor
        for name, tensor in load_file(dst / "model.safetensors").items()
        if name.rpartition(".")[0] not in dequantized or name.rpartition(".")[2] not in _QUANTIZED
    }
    for module, weight in dequantized.items():
        tensors[f"{module}.weight"] = weight
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def _check_checkpoint(
    path: Path, dequantized: dict, tmp_path: Path, method: str, **engine_args
) -> None:
    """The engine on `method` checkpoint `path` generates transformers' greedy tokens on
    its dequantized weights."""
    reference = load_reference(_dequantized_folder(path, tmp_path / "float", dequantized))
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**24, **engine_args)
    assert llm.config.quantization == method
    check_greedy(llm, reference, random_prompts(4, 3, 20))
    llm.shutdown()


@pytest.mark.parametrize("checkpoint", ["qwen3-moe", "qwen2-moe"], indirect=True)
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_fp8_checkpoint_experts_greedy_matches_transformers(
    tmp_path, checkpoint, per_channel, static
):
    """Experts stored fp8 with their scales load as stored (a static input_scale is
    accepted: experts compute weight-only)."""
    path = tmp_path / "fp8"
    dequantized = write_fp8_checkpoint(checkpoint, path, per_channel, static)
    assert any(".experts." in module for module in dequantized)
    _check_checkpoint(path, dequantized, tmp_path, "fp8")


def test_fp8_checkpoint_experts_without_scales_are_a_clear_error(tmp_path, tiny_checkpoint):
    path = tmp_path / "fp8"
    write_fp8_checkpoint(tiny_checkpoint("qwen3-moe"), path, True, False)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.1.up_proj.weight_scale"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts expert 1 up has no weight_scale"):
        LLM(str(path), dtype="float32", kv_cache_memory=2**24)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("expert_parallel", [False, pytest.param(True, marks=SLOW)])
def test_fp8_checkpoint_experts_on_two_ranks(tmp_path, tiny_checkpoint, expert_parallel):
    """Per-channel scales are sliced with the rows they scale (tensor parallel), or kept
    whole with whole experts (expert parallel)."""
    path = tmp_path / "fp8"
    dequantized = write_fp8_checkpoint(tiny_checkpoint("qwen3-moe"), path, True, False)
    parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": expert_parallel}
    _check_checkpoint(path, dequantized, tmp_path, "fp8", **parallel)


# The experts' intermediate size: whole groups of 32 and 64, and runs of 32, on two ranks.
INT_MOE_SIZES = {"moe_intermediate_size": 64}
INT_MOE_CASES = [
    IntFormat("awq", group=32),
    IntFormat("gptq", bits=4, group=32, sym=True),
    IntFormat("gptq", bits=8, group=64, sym=True),
    IntFormat("compressed-tensors", bits=4, group=32, sym=True),
    IntFormat("compressed-tensors", bits=8, group=-1),
]


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.parametrize("fmt", INT_MOE_CASES, ids=str)
def test_int_checkpoint_experts_greedy_matches_transformers(tmp_path, tiny_checkpoint, fmt):
    source = tiny_checkpoint("qwen3-moe", **INT_MOE_SIZES)
    path = tmp_path / "model"
    dequantized = write_quantized(source, path, fmt.quantize, fmt.config())
    assert any(".experts." in module for module in dequantized)
    _check_checkpoint(path, dequantized, tmp_path, fmt.method)


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.gpus(2)
@pytest.mark.parametrize(
    ("fmt", "expert_parallel"),
    [
        (IntFormat("awq", group=32), False),
        pytest.param(IntFormat("compressed-tensors", bits=8, group=-1), False, marks=SLOW),
        pytest.param(IntFormat("awq", group=32), True, marks=SLOW),
    ],
    ids=["awq-tp", "channel-tp", "awq-ep"],
)
def test_int_checkpoint_experts_on_two_ranks(tmp_path, tiny_checkpoint, fmt, expert_parallel):
    """Each rank's part is cut from the unpacked weight: gate/up rows, down's input
    features with their groups or its one scale per channel (tensor parallel), or whole
    experts (expert parallel)."""
    path = tmp_path / "model"
    source = tiny_checkpoint("qwen3-moe", **INT_MOE_SIZES)
    dequantized = write_quantized(source, path, fmt.quantize, fmt.config())
    parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": expert_parallel}
    _check_checkpoint(path, dequantized, tmp_path, fmt.method, **parallel)


ACT_ORDER_CASES = [
    IntFormat("gptq", bits=4, group=32, desc_act=True),
    IntFormat("gptq", bits=8, group=16, sym=True, desc_act=True),
    IntFormat("compressed-tensors", bits=4, group=32, desc_act=True),
]


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.parametrize("fmt", ACT_ORDER_CASES, ids=str)
def test_act_order_experts_greedy_matches_transformers(tmp_path, tiny_checkpoint, fmt):
    """Act-order experts (GPTQ desc_act, compressed-tensors actorder "group"): down's
    groups taken in order as the rank's intermediate features, gate and up gathering x per
    expert."""
    source = tiny_checkpoint("qwen3-moe", **INT_MOE_SIZES)
    path = tmp_path / "model"
    dequantized = write_quantized(source, path, fmt.quantize, fmt.config())
    _check_checkpoint(path, dequantized, tmp_path, fmt.method)


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.gpus(2)
@pytest.mark.parametrize("group", [pytest.param(32, marks=SLOW), 64])
def test_act_order_experts_on_two_ranks(tmp_path, tiny_checkpoint, group):
    """Each rank takes down's input features in g_idx order, not checkpoint order (whole
    groups of 32, or halves of groups of 64 with their group's scales), and the same rows
    of gate and up."""
    fmt = IntFormat("gptq", bits=4, group=group, desc_act=True)
    path = tmp_path / "model"
    source = tiny_checkpoint("qwen3-moe", **INT_MOE_SIZES)
    dequantized = write_quantized(source, path, fmt.quantize, fmt.config())
    _check_checkpoint(path, dequantized, tmp_path, fmt.method, tensor_parallel_size=2)


@pytest.mark.gpus(2)
def test_act_order_runs_the_kernels_cannot_take_are_refused(tmp_path, tiny_checkpoint):
    """48 intermediate features in groups of 16 on two ranks: runs of 8 on each."""
    fmt = IntFormat("gptq", bits=8, group=16, sym=True, desc_act=True)
    path = tmp_path / "model"
    source = tiny_checkpoint("qwen3-moe", moe_intermediate_size=48)
    write_quantized(source, path, fmt.quantize, fmt.config())
    with pytest.raises(Exception, match=r"down: 24 input features per rank split its act-order"):
        LLM(str(path), dtype="float32", kv_cache_memory=2**24, tensor_parallel_size=2)
