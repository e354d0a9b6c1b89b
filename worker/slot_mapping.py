"""Slot mapping: the flat KV-cache slot of every scheduled token.

slot = block_table[req, pos // block_size] * block_size + pos % block_size, and -1
(PAD_SLOT_ID) for the padding tokens between query_start_loc[-1] and the padded length.
"""

import torch
import triton
import triton.language as tl

PAD_SLOT_ID = -1


@triton.jit
def _slot_mapping_kernel(
    block_table_ptr,
    block_table_stride,
    query_start_loc_ptr,
    positions_ptr,
    out_ptr,
    num_reqs,
    num_tokens_padded,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    PAD: tl.constexpr,
):
    req = tl.program_id(0)
    offsets = tl.arange(0, TILE)
    if req < num_reqs:
        start = tl.load(query_start_loc_ptr + req).to(tl.int64)
        end = tl.load(query_start_loc_ptr + req + 1).to(tl.int64)
        row_ptr = block_table_ptr + req.to(tl.int64) * block_table_stride
        for tile_start in range(start, end, TILE):
            idx = tile_start + offsets
            mask = idx < end
            pos = tl.load(positions_ptr + idx, mask=mask, other=0).to(tl.int64)
            block_id = tl.load(row_ptr + pos // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
            tl.store(out_ptr + idx, block_id * BLOCK_SIZE + pos % BLOCK_SIZE, mask=mask)
    else:
        start = tl.load(query_start_loc_ptr + num_reqs).to(tl.int64)
        for tile_start in range(start, num_tokens_padded, TILE):
            idx = tile_start + offsets
            pad = tl.full([TILE], PAD, tl.int64)
            tl.store(out_ptr + idx, pad, mask=idx < num_tokens_padded)


def slot_mapping_triton(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    num_tokens_padded: int | None = None,
    tile: int = 1024,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch, one program per request plus one that writes the padding."""
    num_reqs = query_start_loc.shape[0] - 1
    out = _output(positions, num_tokens_padded, out)
    num_out = out.shape[0]
    _slot_mapping_kernel[(num_reqs + 1,)](
        block_table,
        block_table.stride(0),
        query_start_loc,
        positions,
        out,
        num_reqs,
        num_out,
        BLOCK_SIZE=block_size,
        TILE=tile,
        PAD=PAD_SLOT_ID,
    )
    return out


def slot_mapping_torch(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    num_tokens_padded: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    num_tokens = int(query_start_loc[-1])
    out = _output(positions, num_tokens_padded, out)
    tokens_per_req = query_start_loc[1:] - query_start_loc[:-1]
    req_indices = torch.repeat_interleave(
        torch.arange(tokens_per_req.shape[0], device=positions.device),
        tokens_per_req,
        output_size=num_tokens,
    )
    pos = positions[:num_tokens].long()
    block_ids = block_table[req_indices, pos // block_size].long()
    out[:num_tokens] = block_ids * block_size + pos % block_size
    out[num_tokens:] = PAD_SLOT_ID
    return out


def _output(
    positions: torch.Tensor, num_tokens_padded: int | None, out: torch.Tensor | None
) -> torch.Tensor:
    """`out`, or a new int64 tensor of the padded length (positions' length by default)."""
    if out is not None:
        if num_tokens_padded is not None and out.shape[0] != num_tokens_padded:
            raise ValueError(f"out has {out.shape[0]} rows, not {num_tokens_padded}")
        return out
    num_out = positions.shape[0] if num_tokens_padded is None else num_tokens_padded
    return torch.empty(num_out, dtype=torch.int64, device=positions.device)
