"""The worker group the handshake describes: the KV cache every rank can hold, the slowest
rank's costs, CUDA only when every rank is; fresh workers must hold the cache in use."""

import pytest

from engine_core.worker_handshake import WorkerInfo, check_replacements, group_spec
from ipc.executor import WorkerFailure, WorkerGroupSpec
from ipc.messages import WorkerReady


def _workers(*readies: dict) -> list[WorkerInfo]:
    defaults = dict(num_kv_blocks=40, pid=1, hostname="h", kv_cache_groups=[8, None])
    return [
        WorkerInfo(rank, f"w{rank}".encode(), WorkerReady(rank, **{**defaults, **ready}))
        for rank, ready in enumerate(readies)
    ]


def test_the_group_holds_what_every_rank_holds_at_the_slowest_ranks_pace():
    workers = _workers(
        dict(num_host_blocks=9, block_copy_seconds=1.0, prefill_token_seconds=4.0),
        dict(num_kv_blocks=30, num_host_blocks=7, block_copy_seconds=2.0, device_type="cuda"),
    )
    assert group_spec(workers, None) == WorkerGroupSpec(
        30, (8, None), 7, 2.0, 4.0, "cpu", worker_processes=True
    )
    assert group_spec(workers, 20).num_kv_blocks == 20
    assert group_spec(workers, 99).num_kv_blocks == 30


def test_the_group_runs_on_cuda_only_when_every_rank_does():
    workers = _workers(dict(device_type="cuda"), dict(device_type="cuda"))
    assert group_spec(workers, None).device_type == "cuda"


@pytest.mark.parametrize(
    ("ready", "error"),
    [
        (dict(), None),
        (dict(num_kv_blocks=29), "hold 29 KV blocks, fewer than the 30 in use"),
        (dict(num_host_blocks=6), "hold 6 host KV blocks, fewer than the 7 in use"),
        (dict(kv_cache_groups=[None]), r"groups \[None\] differ from those in use \[8, None\]"),
    ],
)
def test_fresh_workers_must_hold_the_kv_cache_in_use(ready, error):
    in_use = WorkerGroupSpec(30, (8, None), 7)
    workers = _workers(dict(num_host_blocks=8), {"num_host_blocks": 8, **ready})
    workers[0].ready.kv_cache_groups = workers[1].ready.kv_cache_groups  # ranks agree
    if error is None:
        check_replacements(workers, in_use)
    else:
        with pytest.raises(WorkerFailure, match=error):
            check_replacements(workers, in_use)
