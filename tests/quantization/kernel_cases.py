"""What the block-quantized kernel tests share: weight layouts, random weights, the int8
reference and the scale rounding errors are relative to."""

import torch

from models.quantization.block_quant import BlockQuantWeight, pack_int4

# (K, block_size): GGUF's 32, Q6_K's 16, group sizes, a per-channel scale (block = K), and
# blocks of 48 (a run of 32 then straddles two blocks).
LAYOUTS = [
    (32, 16), (64, 32), (576, 32), (96, 16), (512, 128), (256, 64), (2048, 2048), (96, 48)
]  # fmt: skip


def make_weight(
    n: int, k: int, bits: int, block_size: int, mins: bool, scale_dtype: torch.dtype, seed: int = 0
) -> BlockQuantWeight:
    g = torch.Generator().manual_seed(seed)
    blocks = (n, k // block_size)
    scales = (torch.rand(blocks, generator=g) * 0.05 + 0.01).to(scale_dtype)
    offsets = None if not mins else (-torch.rand(blocks, generator=g) * 0.4).to(scale_dtype)
    if bits == 4:
        qweight = pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    else:
        qweight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return BlockQuantWeight(bits, qweight, scales, offsets, block_size)


def args(w: BlockQuantWeight) -> tuple:
    return w.qweight, w.scales, w.mins, w.bits, w.block_size


def magnitude(x: torch.Tensor, w: BlockQuantWeight) -> torch.Tensor:
    """|x| |W|^T: the scale a sum's rounding error is relative to."""
    return x.double().abs() @ w.dequantize(torch.float64).abs().T


def int8_reference(
    x: torch.Tensor, w: BlockQuantWeight, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized per 32 features as the kernel does it, times W, in float64; and the
    dequantized x."""
    m, k = x.shape
    runs = x.float().reshape(m, k // 32, 32)
    d = runs.abs().amax(dim=2, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    xq = (torch.round(runs * inv).clamp(-127, 127) * d).reshape(m, k)
    out = xq.double() @ w.dequantize(torch.float64).T
    return (out if bias is None else out + bias.double()), xq
