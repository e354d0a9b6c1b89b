"""When steps speculate: only where it measurably pays.

Verifying k drafts makes a step dearer than a plain one: the drafts' compute (nearly free
while a step is bound by reading the weights, as a small-batch GPU decode; nearly linear
in the tokens once it is compute-bound, as a CPU step of more than a few requests), the
lockstep (a step with drafts loses the overlap of async scheduling) and the rejected
drafts. Whether the accepted drafts make up for it depends on the hardware, the batch and
the text, so the gate measures it, for each batch-size bucket (running requests, to the
nearest power of two on a log scale) on its own. A bucket alternates:

    measure: _WINDOW steps with drafts, then _WINDOW without
    run:     the faster of the two (generated tokens per second) for a run of steps

A run lasts _MIN_RUN of the bucket's steps, doubling (up to _MAX_RUN) each time the same
mode wins again; then both are measured again. A window with drafts ends after _EARLY
steps when they generate less than _EARLY_RATIO of the bucket's last plain rate: drafts
that never pay (a draft model whose drafts are rejected) then cost 2 steps a measurement,
not 8; the plain window is skipped and its last rate kept. A bucket keeps its state while the batch
is in another, so a batch that shrinks and grows goes back to what each size measured. A
bucket seen for the first time starts with a run instead of a measurement when a smaller
bucket found drafts do not pay (a larger batch is more compute-bound, so they pay less)
or a larger one found they do. A step counts from when it was scheduled (or the last
answer, when it was scheduled ahead of it) to its answer. Steps with prefill chunks count
too: new requests arrive in both modes alike, and a server that only counted decode-only
steps would never finish measuring under a steady stream of arrivals.
`disable_by_batch_size` (vLLM's) bounds it outright, and with `adaptive` off every step
below that bound speculates.

Measured on a 2-core AVX2 CPU (SmolLM2-135M Q4_1, k = 4, drafts ~70 % accepted): steps
with drafts generated 2.1x the tokens per second of plain steps with one request running,
0.83x with 8 to 15, 0.81x with 32 to 63 and 0.97x with 64.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ipc.spec_config import SpeculativeConfig

_WINDOW = 8
_MIN_RUN = 16
_MAX_RUN = 512
_EARLY = 2
_EARLY_RATIO = 0.6


def _no_measures() -> dict[bool, list]:
    return {True: [0, 0.0, 0], False: [0, 0.0, 0]}  # tokens, seconds, steps


@dataclass
class BucketState:
    mode: bool = True  # whether the current window or run speculates
    measuring: bool = True
    measured: dict[bool, list] = field(default_factory=_no_measures)
    run_length: int = _MIN_RUN
    run_left: int = 0
    last_winner: bool | None = None
    plain_rate: float | None = None  # of the last full measurement

    def measure(self) -> None:
        self.measuring, self.mode, self.measured = True, True, _no_measures()

    def start_run(self, mode: bool) -> None:
        """A run of _MIN_RUN steps in `mode`, as if it had been measured the winner."""
        self.last_winner = mode
        self.measuring, self.mode = False, mode
        self.run_length = self.run_left = _MIN_RUN

    def count(self, speculated: bool, num_tokens: int, seconds: float) -> None:
        if not self.measuring or speculated != self.mode:
            return
        window = self.measured[speculated]
        window[0] += num_tokens
        window[1] += seconds
        window[2] += 1
        early = self.mode and window[2] >= _EARLY and self.plain_rate is not None
        if early and self._rate(True) < _EARLY_RATIO * self.plain_rate:
            self._run(False)
            return
        if window[2] < _WINDOW:
            return
        if self.mode:
            self.mode = False
            return
        self.plain_rate = self._rate(False)
        self._run(self._rate(True) > self.plain_rate)

    def step_scheduled(self) -> None:
        if not self.measuring:
            self.run_left -= 1
            if self.run_left <= 0:
                self.measure()

    def _rate(self, mode: bool) -> float:
        tokens, seconds, _ = self.measured[mode]
        return tokens / seconds if seconds > 0 else float(tokens)

    def _run(self, winner: bool) -> None:
        self.run_length = min(2 * self.run_length, _MAX_RUN)
        if winner != self.last_winner:
            self.run_length = _MIN_RUN
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
        # step id -> (time scheduled, speculated, bucket)
        self.scheduled: dict[int, tuple[float, bool, int]] = {}

    def bucket(self, num_running: int) -> BucketState:
        index = _bucket(num_running)
        state = self.buckets.get(index)
        if state is None:
            state = self.buckets[index] = BucketState()
            others = self.buckets.items()
            smaller_lost = any(k < index and s.last_winner is False for k, s in others)
            larger_won = any(k > index and s.last_winner is True for k, s in others)
            if smaller_lost or larger_won:
                state.start_run(not smaller_lost)
        return state

    def speculates(self, num_running: int) -> bool:
        """Whether the next step proposes drafts, with `num_running` requests running."""
        bound = self.disable_by_batch_size
        if bound is not None and num_running > bound:
            return False
        return not self.adaptive or self.bucket(num_running).mode

    def step_scheduled(self, step_id: int, num_running: int, speculated: bool) -> None:
        self.scheduled[step_id] = (self.clock(), speculated, _bucket(num_running))
        if self.adaptive:
            self.bucket(num_running).step_scheduled()

    def step_answered(self, step_id: int, num_tokens: int) -> None:
        """Step `step_id` generated `num_tokens` tokens."""
        now = self.clock()
        entry = self.scheduled.pop(step_id, None)
        last, self.last_answer = self.last_answer, now
        if entry is None or not self.adaptive:
            return
        start, speculated, bucket = entry
        seconds = now - max(start, last if last is not None else start)
        self.buckets[bucket].count(speculated, num_tokens, seconds)

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
