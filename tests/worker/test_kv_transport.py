"""KV pages between a producer's and a consumer's workers (worker/kv_transport.py,
worker/kv_connector.py): the pages that arrive are the producer's, page for page (checked
against torch indexing); a transfer is served once, to its key only, over CURVE; a pull that
cannot complete fails within its timeout; and a connector pair reports what landed."""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from ipc.auth import Credentials
from ipc.config import EngineConfig
from ipc.kv_transfer import shared_credentials, transfer_key, transfer_secret
from ipc.messages import KVConnectorMetadata, KVConnectorOutput, KVRecv, KVSend
from ipc.sockets import free_tcp_port
from worker.kv_connector import ZmqConnectorWorker
from worker.kv_transport import (
    PagePull,
    PageServer,
    PullFailed,
    gather_pages,
    pull_pages,
    scatter_pages,
)

PAGE = (4, 2, 8)  # block_size, kv heads, head dim
DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]


def caches(num_tensors: int, num_blocks: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, *PAGE)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(num_tensors)]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gathered_pages_scatter_into_other_blocks_page_for_page(dtype):
    source, target = caches(3, 10, dtype, 0), caches(3, 12, dtype, 1)
    before = [t.clone() for t in target]
    scatter_pages(target, [9, 2, 5], gather_pages(source, [1, 7, 3]))
    for src, dst, old in zip(source, target, before, strict=True):
        for s, d in [(1, 9), (7, 2), (3, 5)]:
            assert same(dst[:, d], src[:, s])
        untouched = [b for b in range(12) if b not in (9, 2, 5)]
        assert same(dst[:, untouched], old[:, untouched])


def test_pages_of_another_layout_are_refused():
    frames = gather_pages(caches(2, 4, torch.float32, 0), [1, 2])
    with pytest.raises(PullFailed, match="another layout"):
        scatter_pages(caches(2, 4, torch.bfloat16, 0), [1, 2], frames)
    with pytest.raises(PullFailed, match="2 KV tensors, this cache has 3"):
        scatter_pages(caches(3, 4, torch.float32, 0), [1, 2], frames)


ENGINE = ("producer-engine", 20000)


@pytest.fixture
def credentials(tmp_path) -> Credentials:
    return shared_credentials(tmp_path / "kv.credentials")


def make_pull(credentials, block_ids, first, num, transfer_id="t", expires=None, engine=ENGINE):
    """A pull of positions first..first+num-1, with the key a producer of `engine` made."""
    expires = time.time() + 60 if expires is None else expires
    secret = transfer_secret(credentials)
    key = transfer_key(secret, *engine, transfer_id, block_ids, expires)
    return PagePull(transfer_id, key, block_ids, expires, first, num)


@pytest.fixture
def server(credentials):
    address = f"tcp://127.0.0.1:{free_tcp_port(count=1)}"
    tensors = caches(2, 8, torch.bfloat16, 3)
    served = threading.Event()
    secret = transfer_secret(credentials)
    server = PageServer(address, tensors, credentials, secret, ENGINE, served)
    yield address, tensors, server
    server.close()


def pull(address, credentials, request: PagePull, timeout=5.0):
    with zmq.Context() as ctx:
        return pull_pages(ctx, address, credentials, request, timeout)


BLOCKS = [[1, 2, 3], [4, 5, 6]]


def test_a_transfer_is_served_at_once_and_only_once(server, credentials):
    address, tensors, served = server
    frames = pull(address, credentials, make_pull(credentials, BLOCKS, 1, 2))
    assert served.on_served.is_set() and served.was_served("t")
    target = caches(2, 8, torch.bfloat16, 4)
    scatter_pages(target, [7, 6, 5, 4], frames)
    for src, dst in zip(tensors, target, strict=True):
        assert same(dst[:, [7, 6, 5, 4]], src[:, [2, 3, 5, 6]])  # positions 1..2 of each group
    with pytest.raises(PullFailed, match="refused"):
        pull(address, credentials, make_pull(credentials, BLOCKS, 1, 2))


@pytest.mark.parametrize(
    "forge",
    [
        lambda p: msgspec.structs.replace(p, key="0" * 64),
        lambda p: msgspec.structs.replace(p, block_ids=[[1, 2, 7], [4, 5, 6]]),
        lambda p: msgspec.structs.replace(p, expires=p.expires + 100),
        lambda p: msgspec.structs.replace(p, transfer_id="other"),
    ],
    ids=["key", "block ids", "end", "transfer id"],
)
def test_a_forged_pull_is_refused_at_once(server, credentials, forge):
    address, _, served = server
    # The server's answer, not the pull's timeout: "refused" is the server's word.
    with pytest.raises(PullFailed, match="answered: refused"):
        pull(address, credentials, forge(make_pull(credentials, BLOCKS, 0, 3)), timeout=60)
    assert not served.on_served.is_set()


def test_keys_are_bound_to_their_producer(server, credentials):
    address, _, _ = server
    other = ("another-engine", 20000)
    with pytest.raises(PullFailed, match="refused"):
        pull(address, credentials, make_pull(credentials, BLOCKS, 0, 1, engine=other))


def test_ended_and_revoked_transfers_are_refused(server, credentials):
    address, _, served = server
    with pytest.raises(PullFailed, match="refused"):
        pull(address, credentials, make_pull(credentials, BLOCKS, 0, 1, expires=time.time() - 1))
    served.revoke("r")
    with pytest.raises(PullFailed, match="refused"):
        pull(address, credentials, make_pull(credentials, BLOCKS, 0, 1, transfer_id="r"))


def test_pages_outside_the_transfer_are_refused(server, credentials):
    address, _, _ = server
    with pytest.raises(PullFailed, match="not in the transfer"):
        pull(address, credentials, make_pull(credentials, BLOCKS, 2, 2))


def test_a_pull_without_the_shared_keys_gets_nothing(server, credentials):
    address, _, served = server
    strangers = Credentials.generate()
    with pytest.raises(PullFailed, match="within 0.5 s"):
        pull(address, strangers, make_pull(credentials, BLOCKS, 0, 1), timeout=0.5)
    assert not served.on_served.is_set()


def _make_credentials(path: str, queue) -> None:
    queue.put(shared_credentials(Path(path)).server_public)


def test_processes_starting_together_share_one_credentials_file(tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    path = str(tmp_path / "sub" / "kv.credentials")
    processes = [ctx.Process(target=_make_credentials, args=(path, queue)) for _ in range(4)]
    for p in processes:
        p.start()
    keys = {queue.get(timeout=60) for _ in processes}
    for p in processes:
        p.join()
    assert len(keys) == 1
    assert (tmp_path / "sub").stat().st_mode & 0o077 == 0


def connector(role: str, port: int, credentials_path, **extra) -> ZmqConnectorWorker:
    config = EngineConfig(
        max_model_len=64,
        kv_transfer_config={
            "engine_id": "producer-engine",
            "kv_role": role,
            "kv_port": port,
            "kv_connector_extra_config": {"credentials": str(credentials_path), **extra},
        },
    )
    return ZmqConnectorWorker(config, torch.device("cpu"))


def finish(*connectors, steps: int = 500):
    """Step the connectors until each reported something; their outputs."""
    outputs = [None] * len(connectors)
    for _ in range(steps):
        for i, c in enumerate(connectors):
            c.start_load_kv(None)
            out = c.get_finished(0.01)
            if out is not None and (
                out.finished_sending or out.finished_recving or out.failed_recving
            ):
                outputs[i] = out
        if all(outputs):
            return outputs
    raise AssertionError(f"transfers did not finish: {outputs}")


def recv_of(pull: PagePull, port: int, block_ids: list[list[int]]) -> KVRecv:
    return KVRecv(
        "D",
        block_ids,
        pull.first_block,
        "127.0.0.1",
        port,
        pull.transfer_id,
        pull.key,
        pull.block_ids,
        pull.expires,
    )


def test_a_connector_pair_moves_a_requests_pages(tmp_path):
    port = free_tcp_port(count=1)
    producer = connector("kv_producer", port, tmp_path / "c")
    consumer = connector("kv_consumer", port, tmp_path / "c")
    source, target = caches(2, 16, torch.bfloat16, 5), caches(2, 16, torch.bfloat16, 6)
    producer.register_kv_caches(source)
    consumer.register_kv_caches(target)
    try:
        request = make_pull(
            producer.credentials, [[3, 4, 5, 6]], 1, 3, engine=("producer-engine", port)
        )
        consumer.start_load_kv(KVConnectorMetadata(recvs=[recv_of(request, port, [[9, 10, 11]])]))
        producer.start_load_kv(KVConnectorMetadata([KVSend("P", "t")]))
        sent, landed = finish(producer, consumer)
        assert sent.finished_sending == ["P"] and landed.finished_recving == ["D"]
        assert landed.pulled_bytes == 2 * 3 * 2 * 4 * 2 * 8 * 2  # tensors x pages x bytes
        for src, dst in zip(source, target, strict=True):
            assert same(dst[:, [9, 10, 11]], src[:, [4, 5, 6]])
        assert producer.get_finished() is None and consumer.get_finished() is None
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_revoked_send_leaves_the_pending_transfers(tmp_path):
    port = free_tcp_port(count=1)
    producer = connector("kv_producer", port, tmp_path / "c")
    producer.register_kv_caches(caches(1, 8, torch.float32, 0))
    try:
        producer.start_load_kv(KVConnectorMetadata([KVSend("P", "t")]))
        assert producer.get_finished() == KVConnectorOutput([], [], {})
        producer.start_load_kv(KVConnectorMetadata(revoked=["t"]))
        assert producer.get_finished() is None
        assert "t" in producer.server.revoked
    finally:
        producer.shutdown()


def test_a_failed_pull_is_reported_with_its_reason(tmp_path):
    port = free_tcp_port(count=1)
    consumer = connector("kv_consumer", port, tmp_path / "c", pull_timeout_s=0.3)
    consumer.register_kv_caches(caches(1, 8, torch.float32, 1))
    try:
        request = make_pull(consumer.credentials, [[1, 2]], 0, 2)
        consumer.start_load_kv(KVConnectorMetadata(recvs=[recv_of(request, port, [[3, 4]])]))
        (failed,) = finish(consumer)
        assert list(failed.failed_recving) == ["D"]
        assert "within 0.3 s" in failed.failed_recving["D"]
    finally:
        consumer.shutdown()
