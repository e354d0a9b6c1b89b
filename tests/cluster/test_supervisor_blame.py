"""Which child the launcher blames when several died (splitserve/supervisor.py)."""

import argparse
import signal
import subprocess
import sys
import time

import pytest

from ipc.config import EngineConfig
from ipc.processes import pid_alive
from splitserve.supervisor import ChildDied, Supervisor

# A process whose threads take a while to go once killed: 1 GiB touched, 8 threads asleep.
BIG = (
    "import threading, time\n"
    "block = bytearray(1 << 30)\n"
    "for _ in range(8): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "print('up', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_killed_worker_still_exiting_is_blamed_not_the_engine_it_took_down():
    """The engine saw the worker gone (its main thread a zombie) and exited with 1; the
    worker's exit code comes only once its last thread has gone. The launcher waits for it
    and names the killed worker, as the log of a killed rank must."""
    engine = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    engine.wait()
    worker = subprocess.Popen([sys.executable, "-c", BIG], stdout=subprocess.PIPE)
    assert worker.stdout.readline() == b"up\n"
    supervisor = Supervisor(
        argparse.Namespace(api_server_count=1), EngineConfig(max_model_len=64), ["ipc://x"]
    )
    supervisor.children = {"engine core": engine, "worker rank 1": worker}
    worker.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(worker.pid) and time.monotonic() < deadline:
        pass
    try:
        with pytest.raises(ChildDied, match="^worker rank 1 died with exit code -9$"):
            supervisor._check_children()
    finally:
        worker.kill()
        worker.wait()
        worker.stdout.close()
