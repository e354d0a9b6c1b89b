"""The CPU decode loop (models/cpu_decode_loop.py) against the Python layers it replaces:
the same tokens and bitwise the same logprobs with the loop on and off, on GGUF weights
(strips or rows, whichever this machine's kernels hold), with and without qkv bias, and
on a dense checkpoint; steps of short rows (chunks of up to SHORT_QUERY_LEN tokens) are
taken, steps it does not take (longer prefills, mixed batches with them) run the layers.
Also the models it refuses and the capsule check between the kernel modules."""

from dataclasses import dataclass

import pytest
import torch

from attention.backends.cpu_backend import SHORT_QUERY_LEN
from attention.forward_context import get_forward_context
from kernels import KernelSet
from models.cpu_decode_loop import CPUDecodeLoop, decode_loop_module
from models.layers.cpu_linear import dense_linear_kernel
from models.quantization.cpu_quant_linear import TILE_ROWS
from splitserve import LLM, SamplingParams
from tests.integration.greedy import random_prompts
from tests.models.tiny import make_tiny_checkpoint
from tests.models.tiny_gguf import write_tiny_gguf

# One type per fused projection (q/k/v, gate/up), as a real file has them.
LOOP_TYPES = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q8_0",
    **{f"blk.0.{n}.weight": "Q4_1" for n in ("attn_q", "attn_k", "attn_v", "attn_output")},
    **{f"blk.0.{n}.weight": "Q4_0" for n in ("ffn_gate", "ffn_up")},
    "blk.0.ffn_down.weight": "Q8_0",
    **{f"blk.1.{n}.weight": "Q8_0" for n in ("attn_q", "attn_k", "attn_v")},
    "blk.1.attn_output.weight": "Q4_0",
    **{f"blk.1.{n}.weight": "Q4_1" for n in ("ffn_gate", "ffn_up", "ffn_down")},
}


@dataclass(frozen=True)
class Step:
    taken: bool  # by the loop
    max_query_len: int


@pytest.fixture
def loop_steps(monkeypatch) -> list[Step]:
    """The steps offered to the loop, recorded as they run."""
    steps = []
    call = CPUDecodeLoop.__call__

    def counted(self, hidden, positions):
        out = call(self, hidden, positions)
        md = get_forward_context().attn_metadata[0]
        steps.append(Step(out is not None, md.max_query_len))
        return out

    monkeypatch.setattr(CPUDecodeLoop, "__call__", counted)
    return steps


def _run(monkeypatch, loop: bool, model: str, **llm_kwargs) -> list:
    monkeypatch.setenv("SPLITSERVE_CPU_DECODE_LOOP", "1" if loop else "0")
    llm = LLM(model, kv_cache_memory=2**24, **llm_kwargs)
    try:
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=10, logprobs=3)
        outs = llm.generate(random_prompts(5, 3, 40), params, use_tqdm=False)
        assert (llm.engine.executor.runner.model.model.decode_loop is not None) == loop
    finally:
        llm.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _check_same(monkeypatch, loop_steps, model: str, **llm_kwargs) -> None:
    with_loop = _run(monkeypatch, True, model, **llm_kwargs)
    taken = [step.taken for step in loop_steps]
    assert any(taken) and not all(taken)  # decodes taken, prefills not
    assert not any(s.taken for s in loop_steps if s.max_query_len > SHORT_QUERY_LEN)
    loop_steps.clear()
    without = _run(monkeypatch, False, model, **llm_kwargs)
    assert not loop_steps
    assert with_loop == without


@pytest.mark.parametrize(
    ("arch", "dtype"), [("llama", "float32"), ("qwen2", "float32"), ("llama", "bfloat16")]
)
def test_gguf_loop_is_bitwise_the_layers(tmp_path, monkeypatch, loop_steps, arch, dtype):
    path, _ = write_tiny_gguf(tmp_path, arch, types=LOOP_TYPES)  # qwen2: qkv bias
    _check_same(monkeypatch, loop_steps, str(path), dtype=dtype)


@pytest.mark.parametrize(
    ("quantization", "dtype"), [(None, "float32"), ("int8", "float32"), (None, "bfloat16")]
)  # bf16: the AMX copies on AMX CPUs, cpu_bf16_linear.cpp on AVX512-BF16 ones
def test_dense_checkpoint_loop_is_bitwise_the_layers(
    tmp_path, monkeypatch, loop_steps, quantization, dtype
):
    model = make_tiny_checkpoint(tmp_path)
    _check_same(monkeypatch, loop_steps, model, dtype=dtype, quantization=quantization)


def test_steps_mixing_prefill_chunks_and_decodes_run_the_layers(tmp_path, monkeypatch, loop_steps):
    path, _ = write_tiny_gguf(tmp_path, "llama", types=LOOP_TYPES)
    _check_same(monkeypatch, loop_steps, str(path), dtype="float32", max_num_batched_tokens=16)


@pytest.mark.parametrize(
    ("dtype", "budget"),
    [("float32", SHORT_QUERY_LEN), ("bfloat16", TILE_ROWS.start - 1)],
)  # bf16 rows from TILE_ROWS on may take the bf16 tiles, which the loop does not run
def test_steps_of_short_rows_are_taken_and_bitwise_the_layers(
    tmp_path, monkeypatch, loop_steps, dtype, budget
):
    """Prompts in chunks of at most `budget` tokens: fresh, after a cached prefix
    (crossing pages), beside decodes, as a speculative step's rows of 1 + k tokens are.
    Every step is short rows and decodes, which the loop takes, bitwise the layers."""
    path, _ = write_tiny_gguf(tmp_path, "llama", types=LOOP_TYPES)
    kwargs = dict(dtype=dtype, max_num_batched_tokens=budget)
    with_loop = _run(monkeypatch, True, str(path), **kwargs)
    assert all(s.taken for s in loop_steps)
    assert any(s.max_query_len > 1 for s in loop_steps)
    loop_steps.clear()
    assert with_loop == _run(monkeypatch, False, str(path), **kwargs)
    assert not loop_steps


@pytest.mark.parametrize(
    ("arch", "env"),
    [
        ("qwen3", {}),  # q/k norms
        ("llama", {"SPLITSERVE_INT8_ACTIVATIONS": "0"}),  # exact float32 products
        ("llama", {"SPLITSERVE_CPU_KERNELS": "0"}),
    ],
)
def test_models_it_does_not_take_run_the_layers(tmp_path, monkeypatch, arch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if arch == "qwen3":
        model = make_tiny_checkpoint(tmp_path, "qwen3")
    else:
        model = str(write_tiny_gguf(tmp_path, arch, types=LOOP_TYPES)[0])
    llm = LLM(model, dtype="float32", kv_cache_memory=2**24)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
        assert llm.engine.executor.runner.model.model.decode_loop is None
    finally:
        llm.shutdown()


def test_a_capsule_of_another_name_is_refused():
    kernels = KernelSet(cpu=True)
    module = decode_loop_module(kernels)
    lent = dense_linear_kernel(kernels).c_api()
    table = torch.zeros(8, 2)
    args = (4, 2, 8, 1e-6, 0.125, table, table)
    module.DecodeLoop(lent, *args)
    with pytest.raises(RuntimeError, match="not a capsule named splitserve.linear_int8"):
        module.DecodeLoop({"linear_int8": lent["dense_linear"]}, *args)
    loop, w, norm = module.DecodeLoop({}, *args), torch.zeros(16, 8), torch.ones(8)
    dense = ("dense_linear", w, None, None, 0, 0, None)
    with pytest.raises(RuntimeError, match="lend no dense_linear"):
        loop.add_layer(norm, norm, dense, dense, dense, dense, 1.0, 1.0, 0)
