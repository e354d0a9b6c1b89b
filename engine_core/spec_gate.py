"""When steps speculate: only where it measurably pays.

Verifying k drafts makes a step dearer than a plain one: the drafts' compute (nearly free
while a step is bound by reading the weights, as a small-batch GPU decode; nearly linear
in the tokens once it is compute-bound, as a CPU step of more than a few requests), the
lockstep (a step with drafts loses the overlap of async scheduling) and the rejected
drafts. Whether the accepted drafts make up for it depends on the hardware, the batch and
the text, so the gate measures it, for each batch-size bucket (running requests, to the
nearest power of two on a log scale) on its own. A bucket alternates:

    measure: _WINDOW steps without drafts, then steps with drafts for as long (in time)
             and at least _MIN_DRAFT_STEPS of them
    run:     the faster of the two (generated tokens per second) for a run of steps

Plain steps come first, so the window with drafts is bounded by what the plain one took:
where a step with drafts costs several plain ones (a large batch on a CPU) the
measurement costs two of them, not eight. A run lasts long enough that what the losing
window cost (its time less what the winner needed for its tokens) is at most _REGRET of
it, and at least _MIN_RUN of the bucket's steps, doubling each time the same mode wins
again, up to _MAX_RUN; then both are measured again. So a measurement that loses a lot
is repeated rarely, and one that loses little (the modes are close) often.

A bucket keeps its state while the batch is in another, so a batch that shrinks and grows
goes back to what each size measured. A bucket seen for the first time starts with a run
instead of a measurement when a smaller bucket found drafts do not pay (a larger batch is
more compute-bound, so they pay less) or a larger one found they do, as long as the
nearest such bucket's run (a draft model whose drafts are never accepted loses at every
size, and each measurement costs it a catch-up pass over every request's context). A step
counts from when it was scheduled (or the last answer, when it was scheduled ahead of it)
to its answer. A step whose prefill tokens outnumber its decoding requests is left out of
a window (its time would say more about the prompts that arrived in it than about the
mode: the first steps of a full batch prefill every prompt), unless the window has
already left out _WINDOW of them: a server under a steady stream of long prompts still
measures. `disable_by_batch_size` (vLLM's) bounds it outright, and with `adaptive` off
every step below that bound speculates.

Measured on a 2-core AVX2 CPU (SmolLM2-135M Q4_1, k = 4, drafts ~70 % accepted): steps
with drafts generated 2.1x the tokens per second of plain steps with one request running,
0.83x with 8 to 15, 0.81x with 32 to 63 and 0.97x with 64.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ipc.spec_config import SpeculativeConfig

_WINDOW = 8
_MIN_DRAFT_STEPS = 2
_MIN_RUN = 16
_MAX_RUN = 512
_REGRET = 0.02

logger = logging.getLogger(__name__)


def _no_measures() -> dict[bool, list]:
    return {True: [0, 0.0, 0], False: [0, 0.0, 0]}  # tokens, seconds, steps


@dataclass
class BucketState:
    size: int = 1  # running requests, a power of two
    mode: bool = False  # whether the current window or run speculates
    measuring: bool = True
    measured: dict[bool, list] = field(default_factory=_no_measures)
    skipped: int = 0  # steps this measurement left out as mostly prefill
    run_length: int = _MIN_RUN
    run_left: int = 0
    last_winner: bool | None = None

    def measure(self) -> None:
        self.measuring, self.mode, self.measured, self.skipped = True, False, _no_measures(), 0

    def start_run(self, mode: bool, length: int = _MIN_RUN) -> None:
        """A run of `length` steps in `mode`, as if it had been measured the winner."""
        self.last_winner = mode
        self.measuring, self.mode = False, mode
        self.run_length = self.run_left = length

    def count(self, speculated: bool, num_tokens: int, seconds: float, prefill: bool) -> None:
        if not self.measuring or speculated != self.mode:
            return
        if prefill and self.skipped < _WINDOW:
            self.skipped += 1
            return
        window = self.measured[speculated]
        window[0] += num_tokens
        window[1] += seconds
        window[2] += 1
        if not self.mode:
            self.mode = window[2] >= _WINDOW
            return
        if window[2] >= _MIN_DRAFT_STEPS and window[1] >= self.measured[False][1]:
            self._run(self._rate(True) > self._rate(False))

    def step_scheduled(self) -> None:
        if not self.measuring:
            self.run_left -= 1
            if self.run_left <= 0:
                self.measure()

    def _rate(self, mode: bool) -> float:
        tokens, seconds, _ = self.measured[mode]
        return tokens / seconds if seconds > 0 else float(tokens)

    def _run(self, winner: bool) -> None:
        length = 2 * self.run_length if winner == self.last_winner else _MIN_RUN
        loser_tokens, loser_seconds, _ = self.measured[not winner]
        _, seconds, steps = self.measured[winner]
        rate = self._rate(winner)
        if seconds > 0 and rate > 0:
            loss = loser_seconds - loser_tokens / rate
            length = max(length, int(loss / (_REGRET * seconds / steps)))
        self.run_length = min(length, _MAX_RUN)
        logger.debug(
            "%d running: drafts %.1f tok/s, plain %.1f tok/s: %s for %d steps",
            self.size,
            self._rate(True),
            self._rate(False),
            "drafts" if winner else "plain",
            self.run_length,
        )
        self.last_winner = winner
        self.measuring, self.mode, self.run_left = False, winner, self.run_length


class SpeculationGate:
    def __init__(
        self, config: SpeculativeConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.disable_by_batch_size = config.disable_by_batch_size
        self.adaptive = config.adaptive
        self.clock = clock
        self.buckets: dict[int, BucketState] = {}
        self.last_answer: float | None = None
        # step id -> (time scheduled, speculated, bucket, mostly prefill)
        self.scheduled: dict[int, tuple[float, bool, int, bool]] = {}

    def bucket(self, num_running: int) -> BucketState:
        index = _bucket(num_running)
        state = self.buckets.get(index)
        if state is None:
            state = self.buckets[index] = BucketState(index)
            others = sorted(self.buckets.items())
            smaller_lost = [s for k, s in others if k < index and s.last_winner is False]
            larger_won = [s for k, s in others if k > index and s.last_winner is True]
            if smaller_lost:
                state.start_run(False, smaller_lost[-1].run_length)
            elif larger_won:
                state.start_run(True, larger_won[0].run_length)
        return state

    def speculates(self, num_running: int) -> bool:
        """Whether the next step proposes drafts, with `num_running` requests running."""
        bound = self.disable_by_batch_size
        if bound is not None and num_running > bound:
            return False
        return not self.adaptive or self.bucket(num_running).mode

    def step_scheduled(
        self, step_id: int, num_running: int, speculated: bool, mostly_prefill: bool
    ) -> None:
        """`mostly_prefill`: its prefill tokens outnumber its decoding requests."""
        entry = (self.clock(), speculated, _bucket(num_running), mostly_prefill)
        self.scheduled[step_id] = entry
        if self.adaptive:
            self.bucket(num_running).step_scheduled()

    def step_answered(self, step_id: int, num_tokens: int) -> None:
        """Step `step_id` generated `num_tokens` tokens."""
        now = self.clock()
        entry = self.scheduled.pop(step_id, None)
        last, self.last_answer = self.last_answer, now
        if entry is None or not self.adaptive:
            return
        start, speculated, bucket, mostly_prefill = entry
        seconds = now - max(start, last if last is not None else start)
        self.buckets[bucket].count(speculated, num_tokens, seconds, mostly_prefill)

    def forget_steps(self) -> None:
        """The steps in flight died with the workers."""
        self.scheduled.clear()


def _bucket(num_running: int) -> int:
    """The power of two nearest `num_running` on a log scale (3 -> 4, 5 -> 4, 6 -> 8), so
    that a batch held at a power of two (max_num_seqs, a closed loop of 64) stays in one
    bucket as requests finish and join."""
    n = max(num_running, 1)
    low = 1 << (n.bit_length() - 1)
    return 2 * low if n * n >= 2 * low * low else low
