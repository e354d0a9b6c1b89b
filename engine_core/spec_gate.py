"""When steps speculate: only where it measurably pays.

Verifying k drafts makes a step dearer than a plain one: the drafts' compute (nearly free
while a step is bound by reading the weights, as a small-batch GPU decode; nearly linear
in the tokens once it is compute-bound, as a CPU step or a large batch), the lockstep (a
step with drafts loses the overlap of async scheduling) and the rejected drafts. Whether
the accepted drafts make up for it depends on the hardware, the batch and the text, so the
gate measures it. It alternates:

    measure: _WINDOW decode-only steps with drafts, then _WINDOW without
    run:     the faster of the two (generated tokens per second) for a run of steps

A run lasts _MIN_RUN steps, doubling (up to _MAX_RUN) each time the same mode wins again;
then both are measured again. A step counts for its mode when it only decoded (a prefill
chunk would make it look slow), from when it was scheduled (or the last answer, when it was
scheduled ahead of it) to its answer. A new batch-size bucket (running requests, powers of
two) starts a new measurement. `disable_by_batch_size` (vLLM's) bounds it outright, and
with `adaptive` off every step below that bound speculates.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ipc.spec_config import SpeculativeConfig

_WINDOW = 8
_MIN_RUN = 16
_MAX_RUN = 512


class SpeculationGate:
    def __init__(
        self, config: SpeculativeConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.disable_by_batch_size = config.disable_by_batch_size
        self.adaptive = config.adaptive
        self.clock = clock
        self.mode = True  # whether the current window or run speculates
        self.measuring = True
        self.bucket: int | None = None
        # [tokens, seconds, steps] measured in this round, with drafts and without.
        self.measured = {True: [0, 0.0, 0], False: [0, 0.0, 0]}
        self.run_length = _MIN_RUN
        self.run_left = 0
        self.last_winner: bool | None = None
        self.last_answer: float | None = None
        self.scheduled: dict[int, tuple[float, bool]] = {}  # step id -> (time, speculated)

    def speculates(self, num_running: int) -> bool:
        """Whether the next step proposes drafts, with `num_running` requests running."""
        bound = self.disable_by_batch_size
        if bound is not None and num_running > bound:
            return False
        if not self.adaptive or _bucket(num_running) != self.bucket:
            return True  # a new bucket's measurement starts with drafts
        return self.mode

    def step_scheduled(self, step_id: int, num_running: int, speculated: bool) -> None:
        if self.adaptive and _bucket(num_running) != self.bucket:
            self.bucket = _bucket(num_running)
            self.last_winner = None
            self._measure()
        self.scheduled[step_id] = (self.clock(), speculated)
        if not self.measuring:
            self.run_left -= 1
            if self.run_left <= 0:
                self._measure()

    def step_answered(self, step_id: int, num_tokens: int, decode_only: bool) -> None:
        """Step `step_id` generated `num_tokens` tokens; `decode_only`: it ran no prefill."""
        now = self.clock()
        entry = self.scheduled.pop(step_id, None)
        last, self.last_answer = self.last_answer, now
        if entry is None or not self.measuring or not decode_only:
            return
        start, speculated = entry
        if speculated != self.mode:
            return
        window = self.measured[speculated]
        window[0] += num_tokens
        window[1] += now - max(start, last if last is not None else start)
        window[2] += 1
        if window[2] < _WINDOW:
            return
        if self.mode:
            self.mode = False
            return
        self._run(self._rate(True) > self._rate(False))

    def forget_steps(self) -> None:
        """The steps in flight died with the workers."""
        self.scheduled.clear()

    def _rate(self, mode: bool) -> float:
        tokens, seconds, _ = self.measured[mode]
        return tokens / seconds if seconds > 0 else float(tokens)

    def _measure(self) -> None:
        self.measuring, self.mode = True, True
        self.measured = {True: [0, 0.0, 0], False: [0, 0.0, 0]}

    def _run(self, winner: bool) -> None:
        self.run_length = min(2 * self.run_length, _MAX_RUN)
        if winner != self.last_winner:
            self.run_length = _MIN_RUN
        self.last_winner = winner
        self.measuring, self.mode, self.run_left = False, winner, self.run_length


def _bucket(num_running: int) -> int:
    return max(num_running, 1).bit_length()
