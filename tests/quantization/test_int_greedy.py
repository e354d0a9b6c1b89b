"""AWQ, GPTQ and compressed-tensors checkpoints written at test time (round-to-nearest
packing of a tiny random model) generate the greedy tokens of transformers running the
same architecture on the dequantized weights."""

import pytest

from splitserve import LLM
from tests.integration.greedy import random_prompts
from tests.quantization.int_formats import IntFormat
from tests.quantization.int_packers import write_quantized
from tests.quantization.reference import check_greedy, check_near_greedy, dequantized_reference

# hidden 128, intermediate 256: input sizes that groups of 32, 64 and 128 divide.
SIZES = {"hidden_size": 128, "intermediate_size": 256}
CASES = [
    ("llama", IntFormat("awq", group=32)),
    ("qwen3", IntFormat("awq", group=64)),
    ("llama", IntFormat("awq", group=128)),
    ("llama", IntFormat("gptq", bits=4, group=32, sym=True)),
    ("qwen3", IntFormat("gptq", bits=4, group=64, desc_act=True)),
    ("llama", IntFormat("gptq", bits=8, group=128, desc_act=True)),
    ("llama", IntFormat("gptq", bits=8, group=32, sym=True)),
    ("llama", IntFormat("compressed-tensors", bits=4, group=32, sym=True)),
    ("qwen3", IntFormat("compressed-tensors", bits=4, group=128)),
    ("llama", IntFormat("compressed-tensors", bits=8, group=-1, sym=True)),
]


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.parametrize(("arch", "fmt"), CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_greedy_matches_transformers_on_the_dequantized_weights(
    tiny_checkpoint, tmp_path, arch, fmt
):
    source = tiny_checkpoint(arch, **SIZES)
    dequantized = write_quantized(source, tmp_path / "model", fmt.quantize, fmt.config())
    reference = dequantized_reference(source, lambda name, w: dequantized[name])
    llm = LLM(str(tmp_path / "model"), dtype="float32", kv_cache_memory=2**24)
    assert llm.config.quantization == fmt.method
    check_greedy(llm, reference, random_prompts(4, 3, 20))


@pytest.mark.parametrize(("arch", "fmt"), CASES[::3], ids=[f"{a}-{f}" for a, f in CASES[::3]])
def test_int8_activations_break_only_near_ties(tiny_checkpoint, tmp_path, arch, fmt):
    """The default float32 path (activations quantized to int8 per 32 features): greedy
    tokens are the reference's or near ties (tests/quantization/reference.py)."""
    source = tiny_checkpoint(arch, **SIZES)
    dequantized = write_quantized(source, tmp_path / "model", fmt.quantize, fmt.config())
    reference = dequantized_reference(source, lambda name, w: dequantized[name])
    llm = LLM(str(tmp_path / "model"), dtype="float32", kv_cache_memory=2**24)
    check_near_greedy(llm, reference, random_prompts(4, 3, 20))


def _tp_case(arch: str, fmt: IntFormat, *marks: pytest.MarkDecorator):
    return pytest.param(arch, fmt, marks=marks, id=f"{arch}-{fmt}")


# Row-parallel shards of act-order groups (uneven, padded) and of contiguous groups (slow:
# two worker processes a case; the act-order one, the hardest cut, runs by default).
TP_CASES = [
    _tp_case("llama", IntFormat("gptq", bits=4, group=64, desc_act=True)),
    _tp_case("qwen3", IntFormat("awq", group=64), pytest.mark.slow),
    _tp_case("llama", IntFormat("compressed-tensors", bits=8, group=32), pytest.mark.slow),
]


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.gpus(2)
@pytest.mark.parametrize(("arch", "fmt"), TP_CASES)
def test_tp2_greedy_matches_transformers(tiny_checkpoint, tmp_path, monkeypatch, arch, fmt):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    source = tiny_checkpoint(arch, **SIZES)
    dequantized = write_quantized(source, tmp_path / "model", fmt.quantize, fmt.config())
    reference = dequantized_reference(source, lambda name, w: dequantized[name])
    llm = LLM(
        str(tmp_path / "model"), tensor_parallel_size=2, dtype="float32", kv_cache_memory=2**24
    )
    check_greedy(llm, reference, random_prompts(4, 3, 20))
