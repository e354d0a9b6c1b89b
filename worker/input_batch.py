"""The persistent batch: one row per live request, kept across steps."""

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ipc.messages import NewRequestData
from ipc.sampling_params import SamplingParams
from worker.block_table import MultiGroupBlockTable
from worker.buffers import BatchStaging
from worker.logits_processors import (
    bad_words_table,
    make_allowed_tokens,
    make_bad_words,
    make_logit_bias,
    make_penalties,
)
from worker.sampler import SAMPLING_EPS, SamplingMetadata, skip_sample_draws


@dataclass
class CachedRequestState:
    """What the model runner remembers of a live request, scheduled this step or not."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    draft_num_computed: int = 0  # leading tokens whose draft-model KV is written

    @classmethod
    def from_new_request(
        cls, new: NewRequestData, device: torch.device | str
    ) -> "CachedRequestState":
        """A seeded request gets its generator here; it lives as long as the request, so
        re-adding the request to the batch continues its random stream. A request replayed
        with outputs gets its generator advanced past the draws those outputs took."""
        seed = new.sampling_params.seed
        generator = None
        if seed is not None:
            generator = torch.Generator(device).manual_seed(seed)
            skip_sample_draws(generator, len(new.output_token_ids))
        return cls(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            sampling_params=new.sampling_params,
            generator=generator,
            block_ids=[list(ids) for ids in new.block_ids],
            num_computed_tokens=new.num_computed_tokens,
            output_token_ids=list(new.output_token_ids),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def check_new_request(new: NewRequestData, vocab_size: int) -> str | None:
    """Why this rank cannot take a new request, or None. The EngineCore checks the same
    at its edge; this keeps one bad request from failing a whole step if it did not."""
    token_ids = new.prompt_token_ids + new.output_token_ids
    if not token_ids or min(token_ids) < 0 or max(token_ids) >= vocab_size:
        return f"token ids must be in [0, {vocab_size})"
    params = new.sampling_params
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words_token_ids", [t for word in params.bad_words_token_ids for t in word]),
    ):
        if any(not 0 <= t < vocab_size for t in ids):
            return f"{name} must be in [0, {vocab_size})"
    return None


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device | str,
        vocab_size: int,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        num_kv_cache_groups: int = 1,
        staging: BatchStaging | None = None,
    ) -> None:
        """`staging`: where the sampling settings and block tables go to the device (the
        ModelRunner's arena); by default pairs of the batch's own."""
        self.max_num_reqs = max_num_reqs
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.vocab_size = vocab_size

        self.req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}

        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        # Speculative decoding: this step's draft tokens of each row, written into its token
        # table right after its known tokens (num_tokens does not count them).
        self.num_draft_tokens = np.zeros(max_num_reqs, dtype=np.int32)

        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        # -1: the request wants no logprobs.
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)
        self.generators: dict[int, torch.Generator] = {}
        # row -> (min_tokens, stop token ids) of rows that may not stop before min_tokens.
        self.min_tokens: dict[int, tuple[int, list[int]]] = {}
        # Logits processing of the rows that use it: (presence, frequency, repetition)
        # penalties, {token id: bias}, allowed token ids.
        self.penalties: dict[int, tuple[float, float, float]] = {}
        self.logit_bias: dict[int, dict[int, float]] = {}
        self.allowed_token_ids: dict[int, list[int]] = {}
        # row -> bad_words_table of the rows with bad words.
        self.bad_words: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # row -> top-k of the rows that want prompt logprobs.
        self.num_prompt_logprobs: dict[int, int] = {}

        self._staging = staging or BatchStaging.standalone(max_num_reqs, device)
        self.block_table = MultiGroupBlockTable(
            max_num_reqs,
            max_num_blocks_per_req,
            block_size,
            device,
            num_kv_cache_groups,
            self._staging.block_tables,
        )
        # (row order, metadata) of the last make_sampling_metadata; None once rows change.
        self._sampling_metadata: tuple[np.ndarray, SamplingMetadata] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, req: CachedRequestState) -> int:
        """Write `req` into the lowest free row and return it."""
        if req.req_id in self.req_id_to_index:
            raise ValueError(f"request {req.req_id} is already in the batch")
        if (req.sampling_params.seed is None) != (req.generator is None):
            raise ValueError(f"request {req.req_id}: a generator goes with a seed, and only then")
        if req.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {req.req_id} has {req.num_tokens} tokens, more than max_model_len "
                f"{self.max_model_len}"
            )
        if None in self.req_ids:
            row = self.req_ids.index(None)
            self.req_ids[row] = req.req_id
        elif len(self.req_ids) < self.max_num_reqs:
            row = len(self.req_ids)
            self.req_ids.append(req.req_id)
        else:
            raise ValueError(f"the batch is full ({self.max_num_reqs} requests)")
        self.req_id_to_index[req.req_id] = row

        num_prompt = len(req.prompt_token_ids)
        self.token_ids[row, :num_prompt] = req.prompt_token_ids
        self.token_ids[row, num_prompt : req.num_tokens] = req.output_token_ids
        self.num_tokens[row] = req.num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens[row] = req.num_computed_tokens

        params = req.sampling_params
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k if 0 < params.top_k < self.vocab_size else 0
        self.min_p[row] = params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        if req.generator is not None:
            self.generators[row] = req.generator
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        if params.min_tokens > 0 and stop_ids:
            self.min_tokens[row] = (params.min_tokens, stop_ids)
        if params.uses_penalties:
            self.penalties[row] = (
                params.presence_penalty,
                params.frequency_penalty,
                params.repetition_penalty,
            )
        if params.logit_bias:
            self.logit_bias[row] = dict(params.logit_bias)
        if params.allowed_token_ids is not None:
            self.allowed_token_ids[row] = list(params.allowed_token_ids)
        if params.bad_words_token_ids:
            self.bad_words[row] = bad_words_table(params.bad_words_token_ids)
        if params.prompt_logprobs is not None:
            self.num_prompt_logprobs[row] = params.prompt_logprobs

        self.block_table.add_row(req.block_ids, row)
        self._sampling_metadata = None
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Free the request's row (leaving a hole) and return it; None if it is not here."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        for per_row in self._per_row_settings:
            per_row.pop(row, None)
        self.block_table.clear_row(row)
        self._sampling_metadata = None
        return row

    def condense(self) -> None:
        """Move the highest live rows into the lowest holes so rows 0..num_reqs-1 are live."""
        num_reqs = self.num_reqs
        holes = [row for row in range(num_reqs) if self.req_ids[row] is None]
        sources = [
            row
            for row in range(len(self.req_ids) - 1, num_reqs - 1, -1)
            if self.req_ids[row] is not None
        ]
        for tgt, src in zip(holes, sources, strict=True):
            self._move_row(src, tgt)
        del self.req_ids[num_reqs:]
        if holes:
            self._sampling_metadata = None

    def _move_row(self, src: int, tgt: int) -> None:
        req_id = self.req_ids[src]
        self.req_ids[tgt], self.req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = tgt
        num_tokens = self.num_tokens[src]
        self.token_ids[tgt, :num_tokens] = self.token_ids[src, :num_tokens]
        for array in (
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens,
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.num_logprobs,
        ):
            array[tgt] = array[src]
        for per_row in self._per_row_settings:
            value = per_row.pop(src, None)
            if value is not None:
                per_row[tgt] = value
        self.block_table.move_row(src, tgt)
        self.block_table.clear_row(src)

    @property
    def _per_row_settings(self) -> tuple[dict, ...]:
        return (
            self.generators,
            self.min_tokens,
            self.penalties,
            self.logit_bias,
            self.allowed_token_ids,
            self.bad_words,
            self.num_prompt_logprobs,
        )

    @property
    def samples_read_tokens(self) -> bool:
        """Whether a row's sampling reads its tokens so far (min_tokens, penalties, bad
        words), so a step cannot be prepared before the last one's samples are appended."""
        return bool(self.min_tokens or self.penalties or self.bad_words)

    def append_token(self, row: int | np.ndarray, token_id: int | np.ndarray) -> None:
        """Append one token to a row, or one token to each of an array of distinct rows."""
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        start = self.num_tokens[row]
        self.token_ids[row, start : start + len(token_ids)] = token_ids
        self.num_tokens[row] += len(token_ids)

    def set_draft_tokens(self, drafts: dict[str, list[int]]) -> None:
        """This step's drafts (request id -> tokens), after the rows' known tokens; rows
        not named have none. The caller has checked that they fit (max_model_len)."""
        self.num_draft_tokens[: len(self.req_ids)] = 0
        row_of = self.req_id_to_index
        for req_id, token_ids in drafts.items():
            row = row_of.get(req_id)
            if row is not None:
                start = self.num_tokens[row]
                self.token_ids[row, start : start + len(token_ids)] = token_ids
                self.num_draft_tokens[row] = len(token_ids)

    def make_sampling_metadata(
        self, row_order: np.ndarray | None = None, draft_offsets: np.ndarray | None = None
    ) -> SamplingMetadata:
        """Sampling settings of the rows `row_order` lists, in that order (logits row i is
        batch row row_order[i]); by default of the live rows in row order. A row verifying
        drafts is listed once per position, `draft_offsets[i]` saying how many of its drafts
        logits row i follows. Reused until the batch or the row order changes, but for
        min_tokens blocking, penalties and bad words, which follow the tokens so far."""
        if row_order is None:
            rows = np.flatnonzero([req_id is not None for req_id in self.req_ids])
        else:
            rows = np.array(row_order, dtype=np.int64)
        cached = self._sampling_metadata
        if cached is None or not np.array_equal(cached[0], rows):
            self._sampling_metadata = cached = (rows, self._build_sampling_metadata(rows))
        if not self.min_tokens and not self.penalties and not self.bad_words:
            return cached[1]
        ends = self.num_tokens[rows]
        if draft_offsets is not None:
            ends = ends + draft_offsets
        tokens = (self.token_ids, self.num_prompt_tokens, ends)
        return replace(
            cached[1],
            blocked_token_ids=self._blocked_token_ids(rows, ends) if self.min_tokens else {},
            penalties=make_penalties(rows, self.penalties, *tokens, self.vocab_size, self.device),
            bad_words=make_bad_words(rows, self.bad_words, *tokens, self.device)
            if self.bad_words
            else None,
        )

    def _blocked_token_ids(self, rows: np.ndarray, ends: np.ndarray) -> dict[int, list[int]]:
        """Stop tokens of the logits rows that follow fewer than min_tokens outputs."""
        blocked = {}
        for i, row in enumerate(rows.tolist()):
            entry = self.min_tokens.get(row)
            if entry and ends[i] - self.num_prompt_tokens[row] < entry[0]:
                blocked[i] = entry[1]
        return blocked

    def _build_sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """The rows' settings are gathered into the staging's host views and committed:
        in the ModelRunner's arena they reach the device with the step's one copy."""
        staging, n = self._staging, len(rows)
        settings = (self.temperature, self.top_p, self.min_p, self.top_k)
        staged = (staging.temperature, staging.top_p, staging.min_p, staging.top_k)
        for values, slot in zip(settings, staged, strict=True):
            np.take(values, rows, out=slot.np[:n])
        temperature_t, top_p_t, min_p_t, top_k_t = (slot.commit(n) for slot in staged)
        temperature, top_p, min_p, top_k = (slot.np[:n] for slot in staged)
        is_random = temperature >= SAMPLING_EPS
        num_logprobs = self.num_logprobs[rows]
        logits_rows = list(enumerate(rows.tolist()))

        def per_logits_row(settings: dict[int, Any]) -> dict[int, Any]:
            return {i: settings[row] for i, row in logits_rows if row in settings}

        return SamplingMetadata(
            temperature=temperature_t,
            top_p=top_p_t if (top_p[is_random] < 1.0).any() else None,
            top_k=top_k_t if (top_k[is_random] > 0).any() else None,
            min_p=min_p_t if (min_p[is_random] > 0.0).any() else None,
            all_greedy=not is_random.any(),
            all_random=bool(is_random.all()),
            generators=per_logits_row(self.generators),
            max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
            allowed_tokens=make_allowed_tokens(
                per_logits_row(self.allowed_token_ids), self.vocab_size, self.device
            ),
            logit_bias=make_logit_bias(per_logits_row(self.logit_bias), self.device),
        )
