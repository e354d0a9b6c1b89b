"""The cluster's processes: with restarts off, a killed worker fails its requests (the
client sees no internals, the log names the worker) and takes the whole cluster down
(non-zero exit, no processes left); SIGTERM shuts it down cleanly (no processes, no
socket files); the EngineCore never imports torch. Worker replacement is in
test_worker_replacement.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ipc.client import EngineClient, RequestError
from ipc.messages import ErrorCode
from ipc.processes import pid_alive
from ipc.sampling_params import SamplingParams
from ipc.sockets import ipc_paths
from tests.cluster.helpers import (
    ROOT,
    TEST_ARGS,
    child_pids,
    start_launch,
    wait_ready,
)


def _start(tmp_path, model: str, *args: str):
    process, log, address_file = start_launch(tmp_path, "--model", model, *TEST_ARGS, *args)
    address = wait_ready(process, log, address_file)
    return process, log, address, child_pids(log.read_text())


def _wait_gone(pids, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@pytest.mark.gpus(2)
def test_killed_worker_without_restarts_fails_requests_and_the_cluster(tmp_path, qwen3_path):
    process, log, address, pids = _start(
        tmp_path, qwen3_path, "--tp", "2", "--max-worker-restarts", "0"
    )
    try:
        victim = pids["worker rank 1"]
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        with EngineClient(address) as client:
            stream = client.stream([1, 2, 3, 4], params)
            next(stream)
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(RequestError, match="the engine failed") as failure:
                for _ in stream:
                    pass
        code = process.wait(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
    output = log.read_text()
    assert failure.value.code == ErrorCode.INTERNAL
    assert str(victim) not in str(failure.value)  # the client sees no internals
    assert code != 0
    assert f"worker rank 1 (pid {victim}) died" in output  # the log keeps them
    assert "splitserve: worker rank 1 died with exit code -9" in output
    assert _wait_gone(pids.values()) == []
    assert not any(p.exists() for p in ipc_paths(address))


def test_sigterm_leaves_no_processes_and_no_socket_files(tmp_path, llama_path):
    process, log, address, pids = _start(tmp_path, llama_path, "--tp", "1")
    assert len(pids) == 2 and all(pid_alive(p) for p in pids.values())
    assert all(p.exists() for p in ipc_paths(address))
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0
    assert _wait_gone(pids.values(), timeout=1.0) == []
    assert not any(p.exists() for p in ipc_paths(address))
    assert not ipc_paths(address)[0].parent.exists()
    assert not (tmp_path / "address").exists()


def test_engine_core_process_imports_no_torch():
    code = (
        "import sys, launch, engine_core.engine_proc, engine_core.multiproc_executor; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
