"""Multi-node style: `launch.py --role engine` on tcp, and the workers started on their
own under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), connecting to it, every
process with a copy of the same credentials file."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from ipc.auth import Credentials
from ipc.client import EngineClient
from ipc.sampling_params import SamplingParams
from ipc.sockets import free_tcp_port
from tests.cluster.helpers import (
    LAUNCH,
    ROOT,
    cluster_env,
    start_launch,
    wait_ready,
)
from tests.integration.greedy import greedy_reference

ENGINE_ARGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB")
PROMPTS = [[5, 77, 3, 200], [42] * 30]


@pytest.mark.gpus(2)
def test_engine_role_with_torchrun_workers(tmp_path, qwen3_path):
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    credentials = tmp_path / "cluster.credentials"
    Credentials.generate().save(credentials)
    engine_args = ["--role", "engine", "--engine-address", address, "--tp", "2"]
    engine_args += ["--credentials", str(credentials)]
    engine, log, address_file = start_launch(
        tmp_path, *engine_args, "--model", qwen3_path, *ENGINE_ARGS
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-port", str(free_tcp_port(count=1))]
    with (tmp_path / "workers.log").open("wb") as out:
        worker_args = ["--role", "worker", "--engine-address", address, "--model", qwen3_path]
        worker_args += ["--credentials", str(credentials)]
        workers = subprocess.Popen(
            [*torchrun, LAUNCH, *worker_args, *ENGINE_ARGS],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cluster_env(),
            cwd=ROOT,
        )
    try:
        assert wait_ready(engine, log, address_file) == address
        with EngineClient(address, credentials=credentials) as client:
            params = SamplingParams(temperature=0.0, max_tokens=8)
            answers = [client.generate(p, params).outputs[0].token_ids for p in PROMPTS]
        greedy = greedy_reference(qwen3_path, ignore_eos=False)
        assert answers == [greedy(p, 8) for p in PROMPTS]
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(timeout=15) == 0
        assert workers.wait(timeout=15) == 0  # every rank got Shutdown
        assert not address_file.exists()
    finally:
        for process in (engine, workers):
            if process.poll() is None:
                process.kill()
