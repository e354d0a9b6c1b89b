"""Whether the workers are alive, and which one to blame when a step fails.

Workers the executor started are checked by their processes; registered workers on this
host by their pids (so a worker started by hand or by the supervisor is checked too);
workers on other hosts only by their messages and the step deadline.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Collection, Sequence

from engine_core.worker_handshake import WorkerInfo
from ipc.messages import WorkerError
from ipc.processes import pid_alive

_DEATH_GRACE_S = 0.5


def dead_worker(
    processes: Sequence[subprocess.Popen],
    workers: Sequence[WorkerInfo],
    hostname: str,
    reported: Collection[int] = (),
) -> str | None:
    """Describe a worker that is gone, other than the ranks that reported an error."""
    for rank, process in enumerate(processes):
        code = process.poll()
        if code is not None and rank not in reported:
            return f"worker rank {rank} (pid {process.pid}) died with exit code {code}"
    for worker in workers:
        if worker.rank in reported or worker.hostname != hostname:
            continue
        if not pid_alive(worker.pid):
            return f"worker rank {worker.rank} (pid {worker.pid}) died"
    return None


def diagnose(
    error: WorkerError,
    dead: Callable[[Collection[int]], str | None],
    more_errors: Callable[[], set[int]],
) -> str:
    """What failed, given a rank's error. That error is often a collective failing because
    another rank died: a rank that dies without a word gets a moment to show, and is named
    first. `dead(reported)` is dead_worker's answer; `more_errors()` the ranks of the
    WorkerErrors that arrived since it was last called."""
    reported = {error.rank}
    suspect = None
    deadline = time.monotonic() + _DEATH_GRACE_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        reported |= more_errors()
        # Gone twice in a row with no error in between: it died without a word (a rank
        # that exits after its own WorkerError may show as gone first).
        found = dead(reported)
        if found is not None and found == suspect:
            last_line = error.message.strip().splitlines()[-1:] or [""]
            return f"{found}; then worker rank {error.rank} failed: {last_line[0]}"
        suspect = found
    step = "" if error.step_id is None else f" at step {error.step_id}"
    return f"worker rank {error.rank} failed{step}:\n{error.message}"
