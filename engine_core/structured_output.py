"""Structured output in the EngineCore: one llguidance matcher per structured request.

The scheduler asks this manager four things: whether a request's grammar compiles (at
add time), how many of a request's draft tokens the grammar allows (speculative decoding
cuts them at the first it forbids), the token bitmask rows of the structured requests
that sample in a step (sent to the workers in the SchedulerOutput, which mask the logits
with them; a request verifying drafts has a row per position, each after the drafts
before it), and, once the step's tokens are back, whether each token kept to the grammar
and whether the grammar is complete. Compiled grammars are cached by spec (LRU); a
request starts from a copy of the cached matcher. A preempted request keeps its matcher as
it is: the tokens it already produced stay accepted.

llguidance is loaded with the first structured request, and the tokenizer read from
the folder's tokenizer.json, so an engine that never sees one starts as fast as before.
Nothing here touches torch.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import numpy as np

from engine_core.request import Request, RequestStatus
from ipc.config import EngineConfig
from ipc.grammar import grammar_of
from ipc.sampling_params import StructuredOutputsParams
from ipc.utils import cdiv

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 256
GRAMMAR_REJECTED = "a sampled token does not match the request's grammar"


class StructuredOutputManager:
    def __init__(self, config: EngineConfig, cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.config = config
        self.cache_size = cache_size
        self.matchers: dict[str, object] = {}  # request id -> its llguidance LLMatcher
        self.num_compiled = 0
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._tokenizer = None
        self._executor = None
        self._bitmask: np.ndarray | None = None

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> str | None:
        """Start the request's matcher; returns why its grammar cannot run, or None."""
        try:
            compiled = self._compile(params)
        except ValueError as e:
            return f"structured_outputs.{params.kind} is invalid: {e}"
        except OSError as e:
            return f"structured output is not available: {e}"
        self.matchers[request_id] = compiled.deep_copy()
        return None

    def num_valid_drafts(self, request_id: str, drafts: list[int]) -> int:
        """How many of the drafts, from the first, the request's grammar accepts."""
        matcher = self.matchers[request_id]
        if matcher.is_stopped():
            return 0
        return matcher.validate_tokens(drafts)

    def grammar_bitmask(
        self,
        requests: dict[str, Request],
        num_scheduled_tokens: dict[str, int],
        drafts: dict[str, list[int]] | None = None,
    ) -> tuple[list[str], bytes]:
        """The ids of the structured requests that sample this step (their tokens are all
        computed once the step runs; a partial prefill chunk does not sample) and their
        bitmask rows, in that order: one row each, or 1 + len(drafts) rows for a request
        verifying drafts (the grammar advanced through them for the masks, then rolled
        back: only the tokens the step returns are consumed)."""
        if not self.matchers:
            return [], b""
        ids = []
        for request_id in self.matchers:
            num_new = num_scheduled_tokens.get(request_id)
            if num_new:
                request = requests[request_id]
                if request.num_computed_tokens + num_new >= request.num_tokens:
                    ids.append(request_id)
        if not ids:
            return [], b""
        import llguidance.numpy as llg_numpy

        drafts = drafts or {}
        if any(request_id in drafts for request_id in ids):
            return ids, self._bitmask_with_drafts(ids, drafts)
        bitmask = self._bitmask_rows(len(ids))
        if len(ids) == 1:
            llg_numpy.fill_next_token_bitmask(self.matchers[ids[0]], bitmask, 0)
        else:
            pairs = [(self.matchers[request_id], i) for i, request_id in enumerate(ids)]
            llg_numpy.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
        return ids, bitmask.tobytes()

    def _bitmask_with_drafts(self, ids: list[str], drafts: dict[str, list[int]]) -> bytes:
        import llguidance.numpy as llg_numpy

        counts = [1 + len(drafts.get(request_id, ())) for request_id in ids]
        bitmask = self._bitmask_rows(sum(counts))
        row = 0
        for request_id, count in zip(ids, counts, strict=True):
            matcher = self.matchers[request_id]
            for position in range(count):
                llg_numpy.fill_next_token_bitmask(matcher, bitmask, row)
                row += 1
                if position < count - 1 and not matcher.consume_token(drafts[request_id][position]):
                    raise RuntimeError(f"request {request_id}: a validated draft was refused")
            matcher.rollback(count - 1)
        return bitmask.tobytes()

    def accept_tokens(self, request: Request, token_ids: list[int]) -> RequestStatus | None:
        """Advance the request's matcher: FINISHED_STOPPED at the EOS that ends a complete
        grammar (even under ignore_eos: a complete grammar allows nothing else),
        FINISHED_ERROR when a token breaks the grammar, else None."""
        matcher = self.matchers[request.request_id]
        if matcher.is_stopped():  # complete: its mask allowed EOS only
            return RequestStatus.FINISHED_STOPPED
        if not matcher.consume_tokens(token_ids):
            error = matcher.get_error().split("\n", 1)[0]
            logger.error("request %s: %s: %s", request.request_id, GRAMMAR_REJECTED, error)
            return RequestStatus.FINISHED_ERROR
        if matcher.is_stopped() and token_ids[-1] in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        return None

    def free(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def _compile(self, params: StructuredOutputsParams):
        """The cached matcher for `params` (never advanced), compiled on a miss."""
        kind = params.kind
        value = getattr(params, kind)
        key = (kind, tuple(value) if isinstance(value, list) else value)
        key += (params.disable_any_whitespace,)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        from llguidance import LLMatcher

        compiled = LLMatcher(self._llg_tokenizer(), grammar_of(params), log_level=0)
        if compiled.is_error():
            raise ValueError(compiled.get_error())
        self.num_compiled += 1
        self._compiled[key] = compiled
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return compiled

    def _llg_tokenizer(self):
        if self._tokenizer is not None:
            return self._tokenizer
        from llguidance import LLExecutor, LLTokenizer

        folder = self.config.tokenizer
        path = Path(folder) / "tokenizer.json" if folder else None
        if path is None or not path.is_file():
            raise FileNotFoundError(f"it needs the tokenizer's tokenizer.json; {folder!r} has none")
        vocab_size = self.config.vocab_size
        eos = self.config.eos_token_ids or None
        self._tokenizer = LLTokenizer(path.read_text(), n_vocab=vocab_size, eos_token=eos)
        self._executor = LLExecutor()
        return self._tokenizer

    def _bitmask_rows(self, num_rows: int) -> np.ndarray:
        """Rows of a buffer allocated once (int32, little-endian on every host we run on)."""
        words = cdiv(self._tokenizer.vocab_size, 32)
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = np.empty((max(num_rows, self.config.max_num_seqs), words), np.int32)
        return self._bitmask[:num_rows]
