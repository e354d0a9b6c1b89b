"""Start launch.py clusters for tests, and watch their processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = str(ROOT / "launch.py")
START_TIMEOUT_S = 120.0
# Small and exact: float32 to match transformers, a small KV cache, one thread per
# process (the machine has 2 cores).
TEST_ARGS = ("--no-api", "--dtype", "float32", "--kv-cache-memory", "64MiB")


@dataclass
class Cluster:
    process: subprocess.Popen
    address: str
    model: str
    log: Path
    pids: dict[str, int]

    def output(self) -> str:
        return self.log.read_text()


def cluster_env() -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )


def start_launch(folder: Path, *args: str) -> tuple[subprocess.Popen, Path, Path]:
    """launch.py with `args`, its output in folder/launch.log; (process, log, address file)."""
    log, address_file = folder / "launch.log", folder / "address"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, LAUNCH, "--address-file", str(address_file), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cluster_env(),
            cwd=ROOT,
        )
    return process, log, address_file


def wait_ready(process: subprocess.Popen, log: Path, address_file: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not address_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"launch.py did not start:\n{log.read_text()}")
        time.sleep(0.1)
    return address_file.read_text().strip()


@contextlib.contextmanager
def launch_cluster(folder: Path, model: str, *args: str) -> Iterator[Cluster]:
    """A running cluster; at the end SIGTERM, and a check that launch.py exits cleanly."""
    process, log, address_file = start_launch(folder, "--model", model, *TEST_ARGS, *args)
    try:
        address = wait_ready(process, log, address_file)
        yield Cluster(process, address, model, log, child_pids(log.read_text()))
    finally:
        process.send_signal(signal.SIGTERM)
        if process.wait(30) != 0:
            raise RuntimeError(f"launch.py exited with {process.returncode}:\n{log.read_text()}")


def child_pids(launch_output: str) -> dict[str, int]:
    found = re.findall(r"splitserve: (.+) pid (\d+)", launch_output)
    return {name: int(pid) for name, pid in found}


def wait_idle(client, timeout: float = 10.0):
    """The engine's stats once no request runs or waits (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while (stats := client.stats()).num_running + stats.num_waiting and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats
