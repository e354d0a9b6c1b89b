"""A step's model inputs: the persistent batch's scheduled tokens, flattened into the
persistent buffers and copied to the device in one copy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attention import AttentionBackend, AttentionMetadata, CommonAttentionMetadata
from attention.batch_split import BatchSplit, split_batch
from worker.buffers import InputBuffers
from worker.cuda_graph import CudaGraphRunner
from worker.input_batch import InputBatch
from worker.sampler import SamplingMetadata


@dataclass
class StepInputs:
    """A step's inputs on the device. A decode step that replays a CUDA graph has them in
    the buffers, padded to `graph_size`, and needs no metadata of its own."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[AttentionMetadata] | None  # per KV cache group
    graph_size: int | None
    sample_rows: np.ndarray  # batch rows that sample a token this step
    # Their logits rows' rows in the hidden states: a row's last token, or for a row that
    # verifies d drafts its last d + 1 tokens (one logits row per position).
    logits_indices: torch.Tensor
    sampling_metadata: SamplingMetadata | None  # when this rank samples and a row does
    logits_rows: np.ndarray  # the batch row of each logits row (sample_rows without drafts)
    # With drafts: each sample row's number of logits rows (d + 1), else None.
    num_logits: np.ndarray | None = None


@dataclass
class PendingSamples:
    """The samples of a step not finished yet: `index[req_id]` is a request's in
    `sampled`, on the device."""

    index: dict[str, int]
    sampled: torch.Tensor


@dataclass
class StagedSplitMetadata(CommonAttentionMetadata):
    """The step's batch with its split worked out already: its index tensors were staged
    with the step's other inputs (one copy), and every KV cache group shares it."""

    staged_split: BatchSplit

    def compute_split(self) -> BatchSplit:
        return self.staged_split


def prepare_inputs(
    batch: InputBatch,
    num_scheduled_tokens: dict[str, int],
    buffers: InputBuffers,
    backend: AttentionBackend,
    cuda_graphs: CudaGraphRunner | None,
    samples: bool = True,
    pending: PendingSamples | None = None,
) -> StepInputs:
    """Flatten the scheduled tokens of rows 0..n-1 into one ragged batch.

    Row i's tokens are positions num_computed[i] .. num_computed[i] + n_i - 1;
    input ids come from the row's token table, slots from its block table. Everything
    the step reads on the device is written into the buffers' host views first (the
    sampling settings too, when `samples`), then copied at once.

    With `pending` (the last step is launched, not finished), a row whose first scheduled
    position is past its known tokens starts at that step's sample: the ids are copied
    from the device samples into input_ids after the host copy.
    """
    num_reqs = batch.num_reqs
    num_scheduled = np.array(
        [num_scheduled_tokens[r] for r in batch.req_ids[:num_reqs]], dtype=np.int64
    )
    total = int(num_scheduled.sum())
    cu_num_tokens = np.cumsum(num_scheduled)
    arange = buffers.arange
    req_indices = np.repeat(arange[:num_reqs], num_scheduled)
    offsets = arange[:total] - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
    num_computed = batch.num_computed_tokens[:num_reqs].astype(np.int64)
    positions_np = buffers.positions.np[:total]
    np.add(num_computed[req_indices], offsets, out=positions_np)
    buffers.input_ids.np[:total] = batch.token_ids[req_indices, positions_np]
    fed = None  # (token indices, sample indices) on the device
    fed_rows = (
        [] if pending is None else np.flatnonzero(num_computed >= batch.num_tokens[:num_reqs])
    )
    if len(fed_rows):
        req_ids, k = batch.req_ids, len(fed_rows)
        buffers.fed_token_indices.np[:k] = (cu_num_tokens - num_scheduled)[fed_rows]
        buffers.fed_sample_indices.np[:k] = [pending.index[req_ids[r]] for r in fed_rows]
        fed = buffers.fed_token_indices.commit(k), buffers.fed_sample_indices.commit(k)
    seq_lens_np = buffers.seq_lens.np[:num_reqs]
    seq_lens_np[:] = num_computed + num_scheduled
    query_start_loc_np = buffers.query_start_loc.np[: num_reqs + 1]
    query_start_loc_np[0] = 0
    query_start_loc_np[1:] = cu_num_tokens
    sample_rows = np.flatnonzero(seq_lens_np >= batch.num_tokens[:num_reqs])
    num_logits, draft_offsets = None, None
    if batch.num_draft_tokens[:num_reqs].any():
        num_logits = batch.num_draft_tokens[sample_rows].astype(np.int64) + 1
        firsts = np.cumsum(num_logits) - num_logits
        draft_offsets = arange[: num_logits.sum()] - np.repeat(firsts, num_logits)
        last_rows = np.repeat(cu_num_tokens[sample_rows] - num_logits, num_logits)
        logits_rows = np.repeat(sample_rows, num_logits)
        buffers.logits_indices.np[: len(draft_offsets)] = last_rows + draft_offsets
    else:
        logits_rows = sample_rows
        buffers.logits_indices.np[: len(sample_rows)] = cu_num_tokens[sample_rows] - 1

    max_query_len = int(num_scheduled.max())
    graph_size = None
    if cuda_graphs is not None and max_query_len == 1 and total == num_reqs:
        graph_size = cuda_graphs.padded_size(num_reqs)
    num_rows, num_tokens = num_reqs, total
    if graph_size is not None:
        buffers.pad_decodes(num_reqs, graph_size)
        num_rows = num_tokens = graph_size

    input_ids = buffers.input_ids.commit(num_tokens)
    positions = buffers.positions.commit(num_tokens)
    query_start_loc = buffers.query_start_loc.commit(num_rows + 1)
    seq_lens = buffers.seq_lens.commit(num_rows)
    logits_indices = buffers.logits_indices.commit(len(logits_rows))
    batch.block_table.commit(num_reqs)
    sampling_metadata = None
    if samples and len(sample_rows):
        sampling_metadata = batch.make_sampling_metadata(logits_rows, draft_offsets)
    query_start_loc_cpu = buffers.query_start_loc.cpu[: num_reqs + 1]
    seq_lens_cpu = buffers.seq_lens.cpu[:num_reqs]
    split = None
    if graph_size is None:
        stage = buffers.split_scratch.stage
        split = split_batch(query_start_loc_cpu, seq_lens_cpu, seq_lens.device, stage)
    buffers.copy_to_device()
    if fed is not None:
        input_ids.index_copy_(0, fed[0], pending.sampled.index_select(0, fed[1]))

    slot_mappings = [
        table.compute_slot_mapping(
            query_start_loc[: num_reqs + 1], positions, out=buffers.slot_mapping[g, :num_tokens]
        )
        for g, table in enumerate(batch.block_table.groups)
    ]
    attn_metadata = None
    if split is not None:
        attn_metadata = [
            backend.build_metadata(
                StagedSplitMetadata(
                    num_actual_tokens=total,
                    max_query_len=max_query_len,
                    max_seq_len=int(seq_lens_np.max()),
                    query_start_loc=query_start_loc,
                    seq_lens=seq_lens,
                    block_table=table.get_device_tensor()[:num_reqs],
                    slot_mapping=slot_mapping,
                    query_start_loc_cpu=query_start_loc_cpu,
                    seq_lens_cpu=seq_lens_cpu,
                    staged_split=split,
                )
            )
            for table, slot_mapping in zip(batch.block_table.groups, slot_mappings, strict=True)
        ]
    return StepInputs(
        input_ids,
        positions,
        attn_metadata,
        graph_size,
        sample_rows,
        logits_indices,
        sampling_metadata,
        logits_rows,
        num_logits,
    )
