"""The workers' registration and KV cache handshake, as the MultiprocExecutor runs it.

Each rank registers with WorkerReady (its block counts, KV cache groups and measured
costs); every rank then gets InitKVCache with the smallest block counts and answers
KVCacheReady once its cache exists. A step runs at the pace of the slowest rank, so the
group's costs are the largest over the ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec

from ipc.executor import WorkerFailure, WorkerGroupSpec
from ipc.messages import KVCacheReady, WorkerReady

logger = logging.getLogger(__name__)

# The next (identity, message) from a worker, None after a poll interval with nothing to
# read; raises WorkerFailure for a WorkerError or a worker that is gone.
Receive = Callable[[], tuple[bytes, msgspec.Struct] | None]


@dataclass
class WorkerInfo:
    rank: int
    identity: bytes
    ready: WorkerReady

    @property
    def pid(self) -> int:
        return self.ready.pid

    @property
    def hostname(self) -> str:
        return self.ready.hostname


def register_workers(
    receive: Receive, world_size: int, address: str, timeout: float
) -> list[WorkerInfo]:
    """Every rank's WorkerReady, by rank. A second WorkerReady for a rank, or from an
    identity that registered already, is ignored."""
    ready: dict[int, WorkerInfo] = {}
    for identity, msg in _until(
        receive,
        timeout,
        lambda: sorted(set(range(world_size)) - set(ready)),
        lambda ranks: f"workers at {address}: no WorkerReady from rank(s) {ranks}",
    ):
        if not isinstance(msg, WorkerReady):
            logger.warning("ignored %s from a worker that is not ready", type(msg).__name__)
        elif not 0 <= msg.rank < world_size:
            raise WorkerFailure(f"unexpected WorkerReady for rank {msg.rank} (tp={world_size})")
        elif msg.rank in ready or any(w.identity == identity for w in ready.values()):
            logger.warning("ignored a second WorkerReady for rank %d (from %r)", msg.rank, identity)
        else:
            ready[msg.rank] = WorkerInfo(msg.rank, identity, msg)
    workers = [ready[rank] for rank in range(world_size)]
    groups = {tuple(w.ready.kv_cache_groups) for w in workers}
    if len(groups) > 1:
        raise WorkerFailure(f"the ranks report different KV cache groups: {list(groups)}")
    return workers


def group_spec(workers: list[WorkerInfo], num_gpu_blocks_override: int | None) -> WorkerGroupSpec:
    """The KV cache every rank can hold (the smallest, and num_gpu_blocks_override if
    smaller) and the slowest rank's costs."""
    ready = [w.ready for w in workers]
    num_blocks = min(r.num_kv_blocks for r in ready)
    if num_gpu_blocks_override is not None:
        num_blocks = min(num_blocks, num_gpu_blocks_override)
    return WorkerGroupSpec(
        num_blocks,
        tuple(ready[0].kv_cache_groups),
        min(r.num_host_blocks for r in ready),
        max(r.block_copy_seconds for r in ready),
        max(r.prefill_token_seconds for r in ready),
        "cuda" if all(r.device_type == "cuda" for r in ready) else "cpu",
        worker_processes=True,
    )


def check_replacements(workers: list[WorkerInfo], spec: WorkerGroupSpec) -> None:
    """Fresh workers must hold the KV cache in use: same groups, at least as many blocks."""
    groups = tuple(workers[0].ready.kv_cache_groups)
    if groups != spec.kv_cache_groups:
        raise WorkerFailure(
            f"the new workers' KV cache groups {list(groups)} differ from those in use "
            f"{list(spec.kv_cache_groups)}"
        )
    fits = min(w.ready.num_kv_blocks for w in workers)
    if fits < spec.num_kv_blocks:
        raise WorkerFailure(
            f"the new workers hold {fits} KV blocks, fewer than the {spec.num_kv_blocks} in use"
        )
    fits = min(w.ready.num_host_blocks for w in workers)
    if fits < spec.num_host_blocks:
        raise WorkerFailure(
            f"the new workers hold {fits} host KV blocks, fewer than the "
            f"{spec.num_host_blocks} in use"
        )


def await_kv_caches(receive: Receive, workers: list[WorkerInfo], timeout: float) -> None:
    """Wait for every rank's KVCacheReady (after InitKVCache): allocating the cache (and
    capturing CUDA graphs) takes seconds, which must not fall on the first step."""
    rank_of = {w.identity: w.rank for w in workers}
    waiting = set(rank_of.values())
    for identity, msg in _until(
        receive,
        timeout,
        lambda: sorted(waiting),
        lambda ranks: f"rank(s) {ranks} to allocate their KV cache",
    ):
        rank = rank_of[identity]
        if isinstance(msg, KVCacheReady) and msg.rank == rank:
            waiting.discard(rank)
        else:
            logger.warning("ignored %s from rank %d before KVCacheReady", type(msg).__name__, rank)


def _until(
    receive: Receive,
    timeout: float,
    pending: Callable[[], list[int]],
    waited_for: Callable[[list[int]], str],
) -> Iterator[tuple[bytes, msgspec.Struct]]:
    """The workers' (identity, message) until no rank is `pending()`; past `timeout`
    seconds fails, naming what the pending ranks owe."""
    deadline = time.monotonic() + timeout
    while missing := pending():
        if time.monotonic() > deadline:
            raise WorkerFailure(f"timed out after {timeout:g} s waiting for " + waited_for(missing))
        received = receive()
        if received is not None:
            yield received
