"""Whether a process on this host is alive, for the launcher and the engine alike."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """False once the process has exited, even while it is an unreaped zombie (Linux)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")
