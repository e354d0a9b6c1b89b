"""Workers as Ray actors (`--distributed-executor-backend ray`, vLLM's flag): one actor per
tensor-parallel rank, in a placement group of one bundle per rank, on whichever nodes of
the Ray cluster have room. Ray is an optional dependency, imported only here.

Each actor runs the same worker as a process would (worker.worker_main.run_worker): it
connects to the EngineCore's tcp address with the worker credentials and meets the other
ranks over torch.distributed at rank 0's node (gloo: GLOO_SOCKET_IFNAME picks the
interface, as for workers started by hand). To the supervisor and the executor an actor
looks like the process it replaces (`RayWorker`: pid, poll, kill, wait), so restarts,
failure detection and data parallelism are the same as with processes.

The launcher joins the Ray cluster of $RAY_ADDRESS, else starts a local one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ipc.auth import WORKER, Credentials
from ipc.config import EngineConfig

READY_TIMEOUT_S = 300.0


@ray.remote(num_cpus=1)
class _WorkerActor:
    def where(self) -> tuple[str, int, int]:
        """(node address, a free port there, pid)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port, os.getpid()

    def run(
        self,
        config_json: str,
        address: str,
        rank: int,
        dist_init: str,
        credentials: Credentials | None,
    ) -> int:
        from worker.worker_main import run_worker

        config = EngineConfig(**json.loads(config_json))
        return run_worker(config, address, rank, dist_init, credentials=credentials)


class RayWorker:
    """One rank's actor, with the process interface the supervisor and executor use."""

    def __init__(self, actor, run_ref, pid: int, group) -> None:
        self.actor, self.pid, self._run, self._group = actor, pid, run_ref, group
        self.returncode: int | None = None
        self._killed = False

    def poll(self) -> int | None:
        if self.returncode is None and ray.wait([self._run], timeout=0)[0]:
            try:
                self.returncode = ray.get(self._run)
            except RayActorError:  # killed, or its node is gone
                self.returncode = -9
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        ray.wait([self._run], timeout=timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"Ray worker pid {self.pid}", timeout)
        return self.returncode

    def kill(self) -> None:
        if not self._killed:
            self._killed = True
            ray.kill(self.actor)
            self._group.release()

    terminate = kill


class _Group:
    """A placement group, removed once every actor in it is killed."""

    def __init__(self, size: int) -> None:
        self.pg = placement_group([{"CPU": 1}] * size, strategy="PACK")
        self._left = size

    def release(self) -> None:
        self._left -= 1
        if self._left == 0:
            remove_placement_group(self.pg)


def start_ray_workers(
    config: EngineConfig, engine_address: str, credentials: Credentials | None
) -> list[RayWorker]:
    """config.tensor_parallel_size actors joining the engine at `engine_address` (tcp, so
    that any node reaches it)."""
    if not engine_address.startswith("tcp://"):
        raise ValueError(
            "Ray workers join the engine over tcp: give --engine-host (and --engine-port)"
        )
    if not ray.is_initialized():
        # Ray's driver handles SIGTERM and SIGINT its own way: the launcher keeps its own.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    size = config.tensor_parallel_size
    group = _Group(size)
    ray.get(group.pg.ready(), timeout=READY_TIMEOUT_S)
    actors = [
        _WorkerActor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group.pg, placement_group_bundle_index=rank
            )
        ).remote()
        for rank in range(size)
    ]
    places = ray.get([actor.where.remote() for actor in actors], timeout=READY_TIMEOUT_S)
    node, port, _ = places[0]
    dist_init = f"tcp://{node}:{port}"
    config_json = json.dumps(dataclasses.asdict(config))
    worker_credentials = None if credentials is None else credentials.for_role(WORKER)
    return [
        RayWorker(
            actor,
            actor.run.remote(config_json, engine_address, rank, dist_init, worker_credentials),
            pid,
            group,
        )
        for rank, (actor, (_, _, pid)) in enumerate(zip(actors, places, strict=True))
    ]
