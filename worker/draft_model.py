"""The draft model of speculative decoding (method draft_model): a smaller model of the
target's tokenizer that runs in each worker beside the target, sharded the same way.

Its KV cache is a group of its own on the target's full-attention block table: every
block id holds the draft's KV of the same tokens in the draft's tensors, so the
EngineCore allocates, caches, swaps and frees one set of blocks for both models.

It runs only in steps that propose (they run in lockstep), once the step's tokens are
known: for each request, one pass over the tokens its KV does not hold yet (a request's
`draft_num_computed`: the whole context at its first proposal, after that the tokens of
the last verification), ending with the last sampled token, then k - 1 single-token
rounds, each drafting the next token and writing the KV of the one before into a
lookahead slot (the scheduler allocated k of them). Slots past the last token are
rewritten by the next catch-up. While the gate keeps drafts off the draft costs nothing.

Every request's draft KV is written by its own catch-ups from position 0 (a prefix-cache
hit spares the target's prefill, not the draft's), so the draft reads only pages written
for the same tokens; a request resumed after a preemption starts over. The draft's KV
only ever shapes proposals: the target verifies them.

Greedy and seeded requests draft greedily: a point mass, which the target's verification
(accept while the draft equals the token sampled at its position) keeps exact, seeded
streams included. Other random requests draw each draft from q, the draft's logits under
the request's temperature, top-k, top-p and min-p, and keep q (`draft_probs`) for the next
step's rejection sampler (rejection_sampler.py), which accepts a draft with probability
min(1, p/q).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from attention import AttentionBackend, CommonAttentionMetadata, set_forward_context
from models import kv_cache_shape_info, load_config, load_model
from models.parallel_state import get_tp_rank, get_tp_size, tp_broadcast
from worker.input_batch import CachedRequestState, InputBatch
from worker.kv_cache_groups import KVCacheGroup
from worker.rejection_sampler import DraftProbs
from worker.sampler import SAMPLING_EPS, sampling_probs
from worker.step_inputs import StepInputs


class DraftModel:
    def __init__(
        self,
        path: str,
        num_speculative_tokens: int,
        target_vocab_size: int,
        kv_cache_groups: list[KVCacheGroup],
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        kernels,
        kv_cache_dtype: str,
        max_model_len: int,
        generator: torch.Generator | None = None,
    ) -> None:
        self.hf_config = load_config(path)
        vocab_size = getattr(self.hf_config, "vocab_size", None)
        if vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config: the draft model {path} has a vocabulary of "
                f"{vocab_size} tokens, the target {target_vocab_size}; they must share a "
                "tokenizer"
            )
        full = [g for g, group in enumerate(kv_cache_groups) if group.sliding_window is None]
        if not full:
            raise ValueError(
                "speculative_config: a draft model needs a target with full-attention "
                "layers (its KV shares their block table)"
            )
        self.group = full[0]
        self.num_groups = len(kv_cache_groups)
        self.model = load_model(path, dtype, device, self.hf_config, kernels=kernels)
        layers = self.model.attention_layers()
        if any(layer.spec.sliding_window is not None for layer in layers):
            raise ValueError(
                f"speculative_config: the draft model {path} has sliding-window layers; "
                "only full attention is supported for a draft"
            )
        for layer in layers:
            layer.spec = replace(layer.spec, kv_cache_dtype=kv_cache_dtype)
        self.num_layers, self.num_kv_heads, self.head_dim = kv_cache_shape_info(
            self.hf_config, get_tp_size()
        )
        self.k = num_speculative_tokens
        self.vocab_size = vocab_size
        self.backend = backend
        self.device = device
        self.max_model_len = max_model_len
        self.generator = generator
        # Request id -> (its last proposal, q of each of its drafts [d, V]): the sampled
        # drafts of the last propose, on the rank that samples.
        self.draft_probs: dict[str, tuple[list[int], torch.Tensor]] = {}

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize

    def bind_kv_cache(self, tensors: list[torch.Tensor]) -> None:
        """One tensor per draft layer: [2, num_blocks, block_size, kv_heads, head_dim]."""
        for tensor, layer in zip(tensors, self.model.attention_layers(), strict=True):
            layer.kv_cache = tensor
            layer.kv_cache_group = self.group

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    @torch.inference_mode()
    def propose(
        self, batch: InputBatch, requests: dict[str, CachedRequestState], req_ids: list[str]
    ) -> dict[str, list[int]]:
        """Up to k drafts after the last token of each request in `req_ids` that still has
        a row: fewer where its allocated slots or max_model_len end first."""
        self.draft_probs = {}
        row_of = batch.req_id_to_index
        ids = [r for r in req_ids if r in row_of and r in requests]
        rows = np.array([row_of[r] for r in ids], dtype=np.int64)
        table = batch.block_table.groups[self.group]
        start = batch.num_tokens[rows].astype(np.int64) - 1  # the last token's position
        writable = np.minimum(table.num_blocks_per_row[rows] * table.block_size, self.max_model_len)
        num_drafts = np.clip(writable - start, 0, self.k)
        keep = np.flatnonzero(num_drafts > 0)
        ids, rows, start, num_drafts = (
            [ids[i] for i in keep],
            rows[keep],
            start[keep],
            num_drafts[keep],
        )
        if not ids:
            return {}
        temperature = np.where(
            [row not in batch.generators for row in rows.tolist()], batch.temperature[rows], 0.0
        )
        top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        sampling = temperature >= SAMPLING_EPS
        probs = None
        if sampling.any() and get_tp_rank() == 0:
            probs = torch.zeros(len(rows), self.k, self.vocab_size, device=self.device)
        computed = np.array([requests[r].draft_num_computed for r in ids], dtype=np.int64)
        first = np.minimum(computed, start)
        drafts = np.zeros((len(rows), self.k), dtype=np.int64)
        everyone = np.arange(len(rows))
        row_of_token, positions = _spans(first, start + 1)
        catch_up = batch.token_ids[rows[row_of_token], positions]
        logits = self._forward(table, rows, catch_up, first, start + 1)
        for r, s in zip(ids, start.tolist(), strict=True):
            requests[r].draft_num_computed = s + 1
        for j in range(int(num_drafts.max())):
            active = everyone if j == 0 else np.flatnonzero(num_drafts > j)
            if j:
                positions = start[active] + j
                tokens = drafts[active, j - 1]
                logits = self._forward(table, rows[active], tokens, positions, positions + 1)
            settings = (temperature[active], top_k[active], top_p[active], min_p[active])
            drafts[active, j] = self._draft_tokens(logits, settings, probs, active, j)
        if probs is not None:
            for i in np.flatnonzero(sampling).tolist():
                proposal = drafts[i, : num_drafts[i]].tolist()
                self.draft_probs[ids[i]] = (proposal, probs[i, : num_drafts[i]])
        return {r: drafts[i, : num_drafts[i]].tolist() for i, r in enumerate(ids)}

    def _draft_tokens(
        self,
        logits: torch.Tensor,
        settings: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        probs: torch.Tensor | None,
        rows: np.ndarray,
        j: int,
    ) -> np.ndarray:
        """Greedy rows take the argmax; sampling rows draw from q, the request's temperature,
        top-k, top-p and min-p applied to the draft's logits (as the target's p has them,
        so that a draft close to the target is accepted as often as it can be), kept in
        probs[rows, j]. Rank 0 decides and broadcasts."""
        temperature, top_k, top_p, min_p = settings
        next_ids = logits.argmax(dim=-1)
        sampling = np.flatnonzero(temperature >= SAMPLING_EPS)
        if probs is not None and len(sampling):
            device = logits.device
            index = torch.from_numpy(sampling).to(device)

            def column(values: np.ndarray, used: np.ndarray) -> torch.Tensor | None:
                return torch.from_numpy(values[sampling]).to(device) if used.any() else None

            q = sampling_probs(
                logits[index].float(),
                torch.from_numpy(temperature[sampling].astype(np.float32)).to(device),
                column(top_k, top_k[sampling] > 0),
                column(top_p, top_p[sampling] < 1.0),
                column(min_p, min_p[sampling] > 0.0),
            )
            cdf = q.cumsum(dim=-1)
            u = torch.rand(len(sampling), 1, generator=self.generator, device=logits.device)
            drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
            next_ids[index] = drawn.clamp(max=q.shape[1] - 1)
            probs[torch.from_numpy(rows[sampling]).to(probs.device), j] = q
        if get_tp_size() > 1:
            tp_broadcast(next_ids, src=0)
        return next_ids.cpu().numpy()

    def _forward(
        self, table, rows: np.ndarray, token_ids: np.ndarray, begin: np.ndarray, end: np.ndarray
    ) -> torch.Tensor:
        """Row i's tokens at positions begin[i] .. end[i] - 1 (`token_ids`, row after row):
        their KV stored, the logits after each row's last one returned."""
        device, block_size = self.device, table.block_size
        query_lens = end - begin
        row_of_token, positions = _spans(begin, end)
        slots = table.np[rows[row_of_token], positions // block_size].astype(np.int64)
        slots = slots * block_size + positions % block_size
        query_start_loc_cpu = torch.zeros(len(rows) + 1, dtype=torch.int32)
        query_start_loc_cpu[1:] = torch.from_numpy(np.cumsum(query_lens))
        seq_lens_cpu = torch.from_numpy(end.astype(np.int32))
        common = CommonAttentionMetadata(
            num_actual_tokens=len(positions),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(end.max()),
            query_start_loc=query_start_loc_cpu.to(device),
            seq_lens=seq_lens_cpu.to(device),
            block_table=table.get_device_tensor()[torch.from_numpy(rows).to(device)],
            slot_mapping=torch.from_numpy(slots).to(device),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        metadata = [self.backend.build_metadata(common)] * self.num_groups
        with set_forward_context(metadata, self.backend):
            hidden = self.model(
                torch.from_numpy(token_ids.astype(np.int64)).to(device),
                torch.from_numpy(positions).to(device),
            )
        last = torch.from_numpy(np.cumsum(query_lens) - 1).to(device)
        return self.model.compute_logits(hidden[last])

    def verification_probs(
        self, batch: InputBatch, step: StepInputs, scheduled_drafts: dict[str, list[int]]
    ) -> DraftProbs | None:
        """The step's sample rows whose drafts were sampled here (q known), as the
        scheduler kept them (a prefix of the proposal, cut by max_tokens or a grammar)."""
        first_rows = np.cumsum(step.num_logits) - step.num_logits
        picked = []
        for i, row in enumerate(step.sample_rows.tolist()):
            drafts = scheduled_drafts.get(batch.req_ids[row])
            entry = self.draft_probs.get(batch.req_ids[row])
            if drafts and entry is not None and entry[0][: len(drafts)] == drafts:
                picked.append((int(first_rows[i]), drafts, entry[1][: len(drafts)]))
        if not picked:
            return None
        k, device = max(len(d) for _, d, _ in picked), self.device
        probs = torch.zeros(len(picked), k, self.vocab_size, device=device)
        draft_ids = torch.zeros(len(picked), k, dtype=torch.long)
        for i, (_, drafts, q) in enumerate(picked):
            probs[i, : len(drafts)] = q
            draft_ids[i, : len(drafts)] = torch.tensor(drafts)
        return DraftProbs(
            torch.tensor([first for first, _, _ in picked], device=device),
            torch.tensor([len(d) for _, d, _ in picked], device=device),
            draft_ids.to(device),
            probs,
        )


def _spans(begin: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For positions begin[i] .. end[i] - 1 of each row i, row after row: each one's row
    index and the position."""
    lengths = end - begin
    row_of_token = np.repeat(np.arange(len(begin)), lengths)
    firsts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = np.repeat(begin, lengths) + np.arange(int(lengths.sum())) - firsts
    return row_of_token, positions
