"""GGUF tensors to BlockQuantWeight: each type against gguf-py's dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from models.quantization.gguf_types import GGUFWeight

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # gguf-py quantizes these
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # gguf-py only dequantizes these
# Byte offsets of the fp16 scales in a block of each K-quant (the rest may be any bytes).
FP16_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(ggml_type: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes]: real blocks of a random matrix, or random raw blocks with
    fp16 scales in a sane range."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[ggml_type]
    if ggml_type in QUANTIZABLE:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
    for offset in FP16_OFFSETS[ggml_type]:
        scale = rng.uniform(-0.05, 0.05, (n, k // elems)).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8).reshape(n, k // elems, 2)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, ggml_type: str) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[ggml_type]))


@pytest.mark.parametrize("ggml_type", QUANTIZABLE + K_QUANTS)
def test_dequantize_equals_gguf(ggml_type):
    n, k = 24, 512
    raw = random_blocks(ggml_type, n, k)
    weight = GGUFWeight(ggml_type, torch.from_numpy(raw), (n, k), "w")
    block_quant = weight.to_block_quant()
    assert block_quant.shape == (n, k)
    expected = reference(raw, ggml_type)
    assert torch.equal(block_quant.dequantize(), expected)


@pytest.mark.parametrize(
    ("ggml_type", "bits", "block_size", "scale_dtype", "has_mins"),
    [
        ("Q8_0", 8, 32, torch.float16, False),
        ("Q4_0", 4, 32, torch.float16, True),
        ("Q4_1", 4, 32, torch.float16, True),
        ("Q5_0", 8, 32, torch.float16, False),
        ("Q5_1", 8, 32, torch.float16, True),
        ("Q4_K", 4, 32, torch.float32, True),
        ("Q5_K", 8, 32, torch.float32, True),
        ("Q6_K", 8, 16, torch.float32, False),
    ],
)
def test_block_quant_layout(ggml_type, bits, block_size, scale_dtype, has_mins):
    raw = random_blocks(ggml_type, 4, 256)
    bq = GGUFWeight(ggml_type, torch.from_numpy(raw), (4, 256)).to_block_quant()
    assert (bq.bits, bq.block_size, bq.scales.dtype) == (bits, block_size, scale_dtype)
    assert (bq.mins is not None) == has_mins
    q = bq.int_values()
    ranges = {"Q5_0": (-16, 15), "Q5_1": (0, 31), "Q5_K": (0, 31), "Q6_K": (-32, 31)}
    low, high = ranges.get(ggml_type, (-128, 127) if bits == 8 else (0, 15))
    assert low <= q.min() and q.max() <= high


def test_q4_0_keeps_float32_scales_when_minus_8d_overflows_float16():
    raw = random_blocks("Q4_0", 2, 64)
    raw[0, :2] = np.array([10000.0], dtype=np.float16).view(np.uint8)
    bq = GGUFWeight("Q4_0", torch.from_numpy(raw), (2, 64)).to_block_quant()
    assert bq.scales.dtype == torch.float32
    assert torch.equal(bq.dequantize(), reference(raw, "Q4_0"))


@pytest.mark.parametrize("ggml_type", ["Q4_1", "Q6_K"])
def test_narrow_rows_and_whole_blocks(ggml_type):
    n, k = 8, 1024
    raw = random_blocks(ggml_type, n, k, seed=1)
    weight = GGUFWeight(ggml_type, torch.from_numpy(raw), (n, k), "blk.0.ffn_down.weight")
    full = reference(raw, ggml_type)
    rows = weight.narrow(0, 2, 4)
    assert rows.shape == (4, k)
    assert torch.equal(rows.to_block_quant().dequantize(), full[2:6])
    cols = weight.narrow(1, 256, 512)
    assert cols.shape == (n, 512)
    assert torch.equal(cols.to_block_quant().dequantize(), full[:, 256:768])


def test_narrow_off_block_names_the_tensor():
    raw = random_blocks("Q4_K", 2, 512)
    weight = GGUFWeight("Q4_K", torch.from_numpy(raw), (2, 512), "blk.3.attn_output.weight")
    with pytest.raises(ValueError, match=r"blk\.3\.attn_output\.weight.*Q4_K blocks of 256"):
        weight.narrow(1, 0, 128)


def test_unknown_type_names_the_tensor_and_type():
    raw = np.zeros((2, 2 * 84), dtype=np.uint8)  # two Q2_K blocks of 84 bytes per row
    weight = GGUFWeight("Q2_K", torch.from_numpy(raw), (2, 512), "blk.1.attn_q.weight")
    with pytest.raises(ValueError, match=r"blk\.1\.attn_q\.weight.*Q2_K"):
        weight.to_block_quant()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight.*Q2_K"):
        weight.to_block_quant("model.layers.1.self_attn.q_proj.weight")
