"""Speculative decoding in the EngineCore: whether a step speculates, the drafts of each
request, and what the verification steps accepted.

A step that carries drafts runs in lockstep: the next step can only be scheduled once it
is known how many of them were accepted (each request's next position depends on it).
So speculating costs the overlap of async scheduling and the verification of the rejected
drafts; it pays only while enough drafts are accepted. `SpeculationGate` turns it off for
the steps where it cannot pay:

* while more requests run than `disable_by_batch_size` (vLLM's bound), and
* for a pause after a window of verification steps whose requests accepted, on average,
  fewer than `min_accepted_per_step` draft tokens each (counting requests that got no
  draft as accepting none). Each pause that follows a failed probe doubles, up to
  `_MAX_PAUSE` steps; a window that pays resets it.
"""

from __future__ import annotations

from collections import deque

from engine_core.ngram_proposer import NgramProposer
from engine_core.request import Request
from ipc.messages import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from ipc.spec_config import SpeculativeConfig

_WINDOW = 8  # verification steps judged together
_MIN_PAUSE = 16  # steps without drafts after a window that did not pay
_MAX_PAUSE = 512


class SpeculationGate:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.disable_by_batch_size = config.disable_by_batch_size
        self.min_accepted = config.min_accepted_per_step
        self.paused_steps = 0
        self.pause = _MIN_PAUSE
        # (speculating requests, accepted drafts) of the recent verification steps.
        self.window: deque[tuple[int, int]] = deque(maxlen=_WINDOW)

    def speculates(self, num_running: int) -> bool:
        """Whether the next step proposes drafts, with `num_running` requests running."""
        bound = self.disable_by_batch_size
        return self.paused_steps == 0 and (bound is None or num_running <= bound)

    def step_scheduled(self, speculated: bool) -> None:
        if not speculated and self.paused_steps:
            self.paused_steps -= 1

    def verified(self, num_requests: int, num_accepted: int) -> None:
        """A verification step's outcome: `num_requests` requests could have speculated
        (decoding in it), and they accepted `num_accepted` drafts together."""
        if not num_requests or not self.min_accepted:
            return
        self.window.append((num_requests, num_accepted))
        if len(self.window) < _WINDOW:
            return
        requests = sum(n for n, _ in self.window)
        accepted = sum(a for _, a in self.window)
        self.window.clear()
        if accepted >= self.min_accepted * requests:
            self.pause = _MIN_PAUSE
            return
        self.paused_steps = self.pause
        self.pause = min(2 * self.pause, _MAX_PAUSE)


class SpecDecodeCounters:
    """vLLM's spec_decode_* counters since start: verification drafts (a request's drafts
    in one step), their tokens, the accepted ones, and accepted ones by position."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def count(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    def fill(self, stats: SchedulerStats) -> None:
        stats.spec_decode_num_drafts = self.num_drafts
        stats.spec_decode_num_draft_tokens = self.num_draft_tokens
        stats.spec_decode_num_accepted_tokens = self.num_accepted_tokens
        stats.spec_decode_num_accepted_tokens_per_pos = list(self.accepted_per_pos)


def spec_decode_summary(before: SchedulerStats, now: SchedulerStats) -> str:
    """The stats line's part for the verifications between two stats: vLLM's acceptance
    rate (accepted / draft tokens), mean acceptance length (tokens per verification,
    the one sampled after the drafts included) and acceptance rate by position."""
    drafts = now.spec_decode_num_drafts - before.spec_decode_num_drafts
    if not drafts:
        return "no drafts"
    draft_tokens = now.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = now.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    old = before.spec_decode_num_accepted_tokens_per_pos or [0] * len(
        now.spec_decode_num_accepted_tokens_per_pos
    )
    per_pos = [
        f"{(n - o) / drafts:.2f}"
        for n, o in zip(now.spec_decode_num_accepted_tokens_per_pos, old, strict=True)
    ]
    return (
        f"acceptance rate {100 * accepted / max(draft_tokens, 1):.1f}%, mean acceptance "
        f"length {1 + accepted / drafts:.2f}, {drafts} drafts, {draft_tokens} draft tokens, "
        f"{accepted} accepted; per position {', '.join(per_pos)}"
    )


class SpecDecoding:
    """Drafts for the requests a step decodes, and the rollback of the rejected ones."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        self.gate = SpeculationGate(config)
        self.counters = SpecDecodeCounters(config.num_speculative_tokens)
        self.max_model_len = max_model_len
        self.num_candidates = 0  # decoding requests of the step being scheduled
        # step id -> its decoding requests, for the speculating steps not yet answered.
        self._candidates: dict[int, int] = {}

    def drafts(self, request: Request, budget: int) -> list[int]:
        """Drafts for a request that decodes one known token this step: as many as the
        budget (after that token), max_tokens and max_model_len leave room for."""
        self.num_candidates += 1
        room = min(budget, self.max_model_len - request.num_tokens) - 1
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        return self.proposer.propose(request.request_id, request.all_token_ids, room)

    def step_scheduled(self, step_id: int, speculated: bool) -> None:
        if speculated:
            self._candidates[step_id] = self.num_candidates
        self.num_candidates = 0
        self.gate.step_scheduled(speculated)

    def roll_back(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
        requests: dict[str, Request],
    ) -> None:
        """Give back the positions of the rejected drafts: a request's next step starts
        right after its last accepted token. Only committed tokens are ever hashed (block
        hashes follow the request's tokens), so the KV cache needs nothing undone."""
        num_candidates = self._candidates.pop(scheduler_output.step_id, None)
        if num_candidates is None:
            return
        drafts = scheduler_output.scheduled_spec_decode_tokens
        num_accepted_total = 0
        sampled = model_runner_output.sampled_token_ids
        for i, request_id in enumerate(model_runner_output.req_ids):
            scheduled = drafts.get(request_id)
            request = requests.get(request_id)
            if scheduled is None or request is None or not sampled[i]:
                continue
            num_accepted = len(sampled[i]) - 1
            request.num_computed_tokens -= len(scheduled) - num_accepted
            self.counters.count(len(scheduled), num_accepted)
            num_accepted_total += num_accepted
        self.gate.verified(num_candidates, num_accepted_total)

    def free(self, request_id: str) -> None:
        self.proposer.free(request_id)

    def forget_steps(self) -> None:
        """The steps in flight died with the workers."""
        self._candidates.clear()
