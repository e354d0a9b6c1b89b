"""A BlockQuantWeight regrouped into strips of 8 output features, the layout the AVX2 and
Arm int8 kernels compute on (models/quantization/cpu_quant_strips.cpp): one 256-bit
load (two 128-bit ones on Arm) then holds the same 4 bytes of 8 rows, one lane per feature.

    q      [N / 8, runs, chunks, 8, 4]   chunk c of a run: bytes 4c .. 4c + 3 of each
                                         feature's run in the row layout (bits=4: 4
                                         chunks of a 16-byte run; bits=8: 8 of 32 bytes)
    scales [N / 8, blocks, 8]            (mins the same)

stored flat as q [N / 8, 8 * row bytes]. Indexing feature f of every chunk gives back its
row's bytes in order, so rows are cheap to read back (`rows`, for embedding lookups and
the torch fallback)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.quantization.block_quant import BlockQuantWeight

STRIP = 8  # output features per strip
CHUNK = 4  # bytes of one feature in a chunk


@dataclass(frozen=True)
class StripQuantWeight:
    bits: int
    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    block_size: int

    @property
    def shape(self) -> tuple[int, int]:
        strips, width = self.q.shape
        row_bytes = width // STRIP
        return strips * STRIP, row_bytes * 2 if self.bits == 4 else row_bytes

    def _chunks(self) -> torch.Tensor:
        """q as [strips, chunks of a row, 8, 4]."""
        return self.q.reshape(self.q.shape[0], -1, STRIP, CHUNK)

    def rows(self, ids: torch.Tensor) -> BlockQuantWeight:
        """The rows `ids` (a 1-D index) in the row layout."""
        strip, feature = ids // STRIP, ids % STRIP
        q = self._chunks()[strip, :, feature].reshape(ids.numel(), -1)
        mins = None if self.mins is None else self.mins[strip, :, feature]
        return BlockQuantWeight(self.bits, q, self.scales[strip, :, feature], mins, self.block_size)

    def row_weight(self) -> BlockQuantWeight:
        """The whole weight in the row layout."""
        n = self.shape[0]
        q = self._chunks().permute(0, 2, 1, 3).reshape(n, -1)

        def table(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1).reshape(n, -1)

        mins = None if self.mins is None else table(self.mins)
        return BlockQuantWeight(self.bits, q, table(self.scales), mins, self.block_size)


def to_strips(w: BlockQuantWeight) -> StripQuantWeight | None:
    """w regrouped into strips; None when its rows are not a whole number of strips."""
    n = w.shape[0]
    if n % STRIP:
        return None
    strips = n // STRIP
    q = w.qweight.reshape(strips, STRIP, -1, CHUNK).permute(0, 2, 1, 3).reshape(strips, -1)

    def table(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(strips, STRIP, -1).permute(0, 2, 1).contiguous()

    mins = None if w.mins is None else table(w.mins)
    return StripQuantWeight(w.bits, q.contiguous(), table(w.scales), mins, w.block_size)
