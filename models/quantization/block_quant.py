"""The block-quantized weight every integer format is repacked into at load.

GGUF (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), AWQ, GPTQ, compressed-tensors and the online
int8 method all become a `BlockQuantWeight`, which the CPU kernel, the Triton kernel and
the torch fallback compute on directly:

    w[n, k] = scales[n, k // block_size] * q[n, k] + mins[n, k // block_size]

(no `mins`: zero). `q` is stored in `qweight`:

* bits=4: uint8 [N, K // 2], q in [0, 15]. Each run of 32 elements along a row is 16
  bytes; byte i holds element i in its low nibble and element i + 16 in its high nibble
  (GGUF's Q4_0/Q4_1 layout), so a 16-byte load gives both halves of a 32-block.
* bits=8: int8 [N, K], q in [-128, 127].

`block_size` is a multiple of 16 that divides K (16 for Q6_K's sub-blocks, 32 for GGUF's
blocks, a group size for AWQ/GPTQ, K for a per-channel scale); K is a multiple of 32.
`scales` and `mins` are float16 or float32 (the same dtype), [N, K // block_size].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PACK_RUN = 32  # elements per run of packed 4-bit values


@dataclass(frozen=True)
class BlockQuantWeight:
    bits: int
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    block_size: int

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        expected = (torch.uint8, k // 2) if self.bits == 4 else (torch.int8, k)
        if (self.qweight.dtype, self.qweight.shape[1]) != expected:
            raise ValueError(f"{self.bits}-bit qweight must be {expected[0]} [N, {expected[1]}]")
        if self.block_size % 16 or k % self.block_size or k % PACK_RUN:
            raise ValueError(f"block size {self.block_size} does not fit {k} input features")
        if self.scales.dtype not in (torch.float16, torch.float32):
            raise ValueError(f"scales must be float16 or float32, got {self.scales.dtype}")
        if tuple(self.scales.shape) != (n, k // self.block_size):
            raise ValueError(f"scales {tuple(self.scales.shape)} != {(n, k // self.block_size)}")
        if self.mins is not None and (
            self.mins.dtype != self.scales.dtype or self.mins.shape != self.scales.shape
        ):
            raise ValueError("mins must match scales in dtype and shape")

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features N, in_features K) of the logical weight."""
        n, width = self.qweight.shape
        return n, width * 2 if self.bits == 4 else width

    @property
    def format(self) -> tuple:
        """What weights must share to be concatenated or stacked."""
        return self.bits, self.block_size, self.scales.dtype, self.mins is None

    def narrow(self, dim: int, start: int, length: int) -> BlockQuantWeight:
        """Rows (dim 0) or input features (dim 1, whole blocks and 32-runs) start:start+length."""
        if dim == 0:
            return BlockQuantWeight(
                self.bits,
                self.qweight.narrow(0, start, length),
                self.scales.narrow(0, start, length),
                None if self.mins is None else self.mins.narrow(0, start, length),
                self.block_size,
            )
        unit = max(self.block_size, PACK_RUN)
        if start % unit or length % unit:
            raise ValueError(
                f"input features {start}:{start + length} do not fall on whole blocks of "
                f"{self.block_size}"
            )
        per_byte = 2 if self.bits == 4 else 1
        b0, nb = start // self.block_size, length // self.block_size
        return BlockQuantWeight(
            self.bits,
            self.qweight.narrow(1, start // per_byte, length // per_byte),
            self.scales.narrow(1, b0, nb),
            None if self.mins is None else self.mins.narrow(1, b0, nb),
            self.block_size,
        )

    def int_values(self) -> torch.Tensor:
        """q as int16 [N, K]."""
        if self.bits == 8:
            return self.qweight.to(torch.int16)
        return unpack_int4(self.qweight).to(torch.int16)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The logical weight [N, K] (computed in float32, then cast)."""
        q = self.int_values().float()
        scales = self.scales.float().repeat_interleave(self.block_size, dim=1)
        w = q * scales
        if self.mins is not None:
            w = w + self.mins.float().repeat_interleave(self.block_size, dim=1)
        return w.to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values in [0, 15] -> the 4-bit qweight [N, K // 2] (layout above)."""
    n, k = q.shape
    runs = q.to(torch.uint8).reshape(n, k // PACK_RUN, 2, PACK_RUN // 2)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [N, K]."""
    n, half = qweight.shape
    runs = qweight.reshape(n, half // (PACK_RUN // 2), 1, PACK_RUN // 2)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(n, half * 2)
