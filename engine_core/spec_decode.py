"""Speculative decoding in the EngineCore: the drafts of each request a step decodes, the
rollback of the rejected ones once the step answers, and the spec_decode counters. Drafts
come from prompt lookup here (ngram) or from the workers' draft model, which proposes them
after each step. When steps speculate at all is the gate's call (spec_gate.py)."""

from __future__ import annotations

from engine_core.ngram_proposer import NgramProposer
from engine_core.request import Request
from engine_core.spec_gate import SpeculationGate
from ipc.messages import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from ipc.spec_config import SpeculativeConfig


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


class DraftModelProposals:
    """The drafts the workers' draft model proposed after a step, kept for the step that
    verifies them. They hold only while the request has exactly the tokens they follow
    (not after a preemption, nor once a later step produced tokens without them)."""

    def __init__(self) -> None:
        self._drafts: dict[str, tuple[int, list[int]]] = {}

    def store(self, request_id: str, num_tokens: int, drafts: list[int]) -> None:
        self._drafts[request_id] = (num_tokens, drafts)

    def propose(self, request_id: str, token_ids: list[int], room: int) -> list[int]:
        entry = self._drafts.pop(request_id, None)
        if entry is None or entry[0] != len(token_ids) or room <= 0:
            return []
        return entry[1][:room]

    def free(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)


class SpecDecoding:
    """Drafts for the requests a step decodes, and the rollback of the rejected ones.
    `num_lookahead_tokens`: slots a request needs beyond its scheduled tokens, where the
    draft model writes the KV of the tokens it drafts (0 for ngram)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.proposer: NgramProposer | DraftModelProposals
        if config.method == "draft_model":
            self.proposer = DraftModelProposals()
            self.num_lookahead_tokens = config.num_speculative_tokens
        else:
            self.proposer = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
            self.num_lookahead_tokens = 0
        self.gate = SpeculationGate(config)
        self.counters = SpecDecodeCounters(config.num_speculative_tokens)
        self.max_model_len = max_model_len

    def drafts(self, request: Request, budget: int) -> list[int]:
        """Drafts for a request that decodes one known token this step: as many as the
        budget (after that token), max_tokens and max_model_len leave room for."""
        room = min(budget, self.max_model_len - request.num_tokens) - 1
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        return self.proposer.propose(request.request_id, request.all_token_ids, room)

    def step_answered(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
        requests: dict[str, Request],
    ) -> None:
        """Give back the positions of the rejected drafts: a request's next step starts
        right after its last accepted token. Only committed tokens are ever hashed (block
        hashes follow the request's tokens), so the KV cache needs nothing undone. Then
        count, keep the draft model's proposals, and tell the gate what the step produced."""
        drafts = scheduler_output.scheduled_spec_decode_tokens
        sampled = model_runner_output.sampled_token_ids
        proposed = model_runner_output.draft_token_ids
        num_tokens = 0
        for i, request_id in enumerate(model_runner_output.req_ids):
            num_tokens += len(sampled[i])
            request = requests.get(request_id)
            if request_id in proposed and request is not None:
                self.proposer.store(
                    request_id, request.num_tokens + len(sampled[i]), proposed[request_id]
                )
            if request_id not in drafts or request is None or not sampled[i]:
                continue
            num_accepted = len(sampled[i]) - 1
            request.num_computed_tokens -= len(drafts[request_id]) - num_accepted
            self.counters.count(len(drafts[request_id]), num_accepted)
        self.gate.step_answered(scheduler_output.step_id, num_tokens)

    def free(self, request_id: str) -> None:
        self.proposer.free(request_id)
