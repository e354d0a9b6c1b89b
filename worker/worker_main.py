"""One tensor-parallel rank as a process: `run_worker(config, engine_address, rank, ...)`.

It connects a DEALER to the engine's workers socket first (so even a failed start is
reported), joins the torch.distributed group, builds its ModelRunner (loading its
shard) and registers with WorkerReady(rank, num_kv_blocks, pid, hostname, KV cache
groups, host-tier blocks and measured copy and prefill costs). After InitKVCache (which
sizes both tiers) it runs every SchedulerOutput it receives, pipelined as
worker/pipeline.py says; only rank 0 answers with the ModelRunnerOutput. Shutdown ends it
with 0; an exception is sent as WorkerError (with the traceback) and ends it with 1, as
does losing the connection to the EngineCore.
"""

from __future__ import annotations

import logging
import os
import socket
import traceback

import torch
import zmq

from ipc.auth import WORKER, Credentials
from ipc.config import EngineConfig
from ipc.messages import (
    TO_WORKERS,
    Decoder,
    FinishStep,
    InitKVCache,
    KVCacheReady,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerError,
    WorkerReady,
    encode,
)
from ipc.sockets import make_socket, socket_address
from models.parallel_state import destroy_distributed, init_distributed
from worker.model_runner import ModelRunner
from worker.pipeline import StepPipeline

logger = logging.getLogger(__name__)

_ERROR_LINGER_MS = 2000
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def run_worker(
    config: EngineConfig,
    engine_address: str,
    rank: int,
    dist_init_address: str,
    world_size: int | None = None,
    credentials: Credentials | None = None,
) -> int:
    """Serve one rank until Shutdown; returns the process exit code. world_size
    defaults to config.tensor_parallel_size; a tcp engine address needs the worker
    credentials (ipc/auth.py)."""
    world_size = world_size or config.tensor_parallel_size
    ctx = zmq.Context()
    sock = make_socket(
        ctx,
        zmq.DEALER,
        socket_address(engine_address, "workers"),
        bind=False,
        identity=f"worker-{rank}-{os.urandom(4).hex()}".encode(),
        credentials=credentials,
        role=WORKER,
    )
    # A lost connection, or credentials the engine refuses, ends the serving loop.
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
    step_id = None
    try:
        _share_cores(config, rank, world_size)
        device = _device(config, rank)
        init_distributed(rank, world_size, dist_init_address, device=device)
        runner = ModelRunner(config, device)
        num_blocks = runner.determine_num_blocks()
        windows = [group.sliding_window for group in runner.kv_cache_groups]
        num_host_blocks = runner.determine_num_host_blocks()
        ready = WorkerReady(
            rank,
            num_blocks,
            os.getpid(),
            socket.gethostname(),
            windows,
            num_host_blocks=num_host_blocks,
            block_copy_seconds=runner.block_copy_seconds,
            prefill_token_seconds=runner.prefill_token_seconds,
            device_type=device.type,
        )
        sock.send(encode(ready))
        logger.info(
            "rank %d of %d ready on %s: %d KV blocks, %d host blocks",
            rank,
            world_size,
            device,
            num_blocks,
            num_host_blocks,
        )
        decoder = Decoder(*TO_WORKERS)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)

        def deliver(answered: int, answer: ModelRunnerOutput | BaseException) -> None:
            nonlocal step_id
            if isinstance(answer, BaseException):
                step_id = answered  # the WorkerError names the step that failed
                raise answer
            if rank == 0:
                sock.send(encode(answer))

        pipeline = StepPipeline(runner.launch, runner.finish, deliver)
        while True:
            timeout = pipeline.wait_timeout()
            ready = dict(poller.poll(None if timeout is None else round(1e3 * timeout)))
            if not ready:  # the launched step may be done by now
                continue
            if sock not in ready:
                logger.error("rank %d lost its connection to the EngineCore; exiting", rank)
                return 1
            msg = decoder.decode(sock.recv())
            if isinstance(msg, SchedulerOutput):
                step_id = msg.step_id
                pipeline.run(msg)
            elif isinstance(msg, FinishStep):
                pipeline.finish_step(msg.step_id)
            elif isinstance(msg, InitKVCache):
                runner.initialize_kv_cache(msg.num_blocks, msg.num_host_blocks)
                runner.capture_cuda_graphs()
                sock.send(encode(KVCacheReady(rank)))
            else:
                destroy_distributed()
                return 0
    except Exception:
        message = traceback.format_exc()
        logger.error("rank %d failed:\n%s", rank, message)
        sock.send(encode(WorkerError(rank, message, step_id)))
        sock.setsockopt(zmq.LINGER, _ERROR_LINGER_MS)
        return 1
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
        ctx.term()


def _share_cores(config: EngineConfig, rank: int, world_size: int) -> None:
    """Share this machine's cores among the ranks of every data-parallel engine, unless
    OMP_NUM_THREADS says otherwise. With several engines each rank is pinned to its own
    cores, so that one engine's busy steps do not slow the others'."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    ranks = world_size * config.data_parallel_size
    share = max(1, len(cores) // ranks)
    torch.set_num_threads(share)
    if config.data_parallel_size > 1 and len(cores) >= ranks:
        first = (config.data_parallel_rank * world_size + rank) * share
        os.sched_setaffinity(0, cores[first : first + share])


def _device(config: EngineConfig, rank: int) -> torch.device:
    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if not cuda:
        return torch.device("cpu")
    index = config.data_parallel_rank * config.tensor_parallel_size + rank
    local_rank = int(os.environ.get("LOCAL_RANK", index % torch.cuda.device_count()))
    return torch.device("cuda", local_rank)
