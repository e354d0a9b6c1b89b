"""Prefill/decode disaggregation in the scheduler (engine_core/kv_connector.py): a
consumer's request waits for its prompt's KV in blocks of its own, then computes only the
last prompt token; a producer's finished request keeps its blocks until they are pulled.
The stand-in executor writes a pull's pages into the consumer's blocks (so a step that
reads a block the pull did not fill is a stale read) and reports transfers as workers do.
"""

import time

import pytest
from stand_in_executor import make_engine, make_request, pull_params, run_to_completion

from engine_core import RequestStatus
from ipc.kv_transfer import (
    EXTRA_DEFAULTS,
    KVTransferParams,
    prompt_hash,
    shared_credentials,
    transfer_key,
    transfer_secret,
)

CONSUMER = {"kv_role": "kv_consumer"}
PRODUCER = {"kv_role": "kv_producer", "kv_ip": "10.0.0.7", "kv_port": 20000}


@pytest.fixture(autouse=True)
def credentials(tmp_path, monkeypatch):
    """Producers make their keys in a file of this test's."""
    monkeypatch.setitem(EXTRA_DEFAULTS, "credentials", str(tmp_path / "kv.credentials"))


PROMPT = list(range(500, 518))  # 18 tokens: 17 pulled, in 5 blocks of 4


def consumer(**kwargs):
    engine, executor = make_engine(kv_transfer_config=CONSUMER, **kwargs)
    executor.remote_kv["A"] = PROMPT
    return engine, executor


def num_free(engine) -> int:
    return engine.kv_cache_manager.block_pool.get_num_free_blocks()


def test_consumer_pulls_all_but_the_last_prompt_token_then_computes_that_one():
    engine, executor = consumer()
    free = num_free(engine)
    engine.add_request(
        make_request("A", PROMPT, max_tokens=3, kv_transfer_params=pull_params(PROMPT))
    )
    engine.step()
    first = executor.outputs[0]
    assert first.num_scheduled_tokens == {}
    (recv,) = first.kv_connector_metadata.recvs
    assert (recv.request_id, recv.block_ids, recv.first_block) == ("A", [[1, 2, 3, 4, 5]], 0)
    assert (recv.host, recv.port, recv.transfer_id, recv.key) == ("10.0.0.7", 20000, "t1", "secret")
    assert recv.remote_block_ids == [[11, 12, 13, 14, 15]]
    assert engine.scheduler.requests["A"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert engine.scheduler.get_stats().num_waiting == 1
    assert num_free(engine) == free - 5
    # Nothing may hit blocks whose pages have not landed.
    assert not engine.kv_cache_manager.block_pool.cached_block_hash_to_block
    results = run_to_completion(engine)
    assert results["A"][1] == "length"
    scheduled = [so for so in executor.outputs if so.num_scheduled_tokens]
    (new,) = scheduled[0].scheduled_new_reqs
    assert (new.num_computed_tokens, new.block_ids) == (17, [[1, 2, 3, 4, 5]])
    assert scheduled[0].num_scheduled_tokens == {"A": 1}
    assert num_free(engine) == free
    stats = engine.scheduler.get_stats()
    assert (stats.kv_transfer_pulls, stats.kv_transfer_failed_pulls) == (1, 0)


def test_pulled_blocks_are_cached_once_they_land():
    engine, executor = consumer()
    engine.add_request(
        make_request("A", PROMPT, max_tokens=1, kv_transfer_params=pull_params(PROMPT))
    )
    run_to_completion(engine)
    engine.add_request(make_request("B", PROMPT, max_tokens=1))
    outputs = run_to_completion(engine)
    assert outputs["B"][1] == "length"
    (new,) = [so for so in executor.outputs if so.scheduled_new_reqs][-1].scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens, new.block_ids[0][:4]) == ("B", 16, [1, 2, 3, 4])


def test_local_prefix_hits_shorten_the_pull():
    engine, executor = consumer()
    engine.add_request(make_request("L", PROMPT[:9], max_tokens=1))
    run_to_completion(engine)
    engine.add_request(
        make_request("A", PROMPT, max_tokens=1, kv_transfer_params=pull_params(PROMPT))
    )
    engine.step()
    (recv,) = executor.outputs[-1].kv_connector_metadata.recvs
    assert recv.first_block == 2
    assert engine.kv_cache_manager.get_block_ids("A")[0][:2] == [1, 2]  # L's blocks
    assert len(recv.block_ids[0]) == 3
    run_to_completion(engine)
    (new,) = executor.outputs[-1].scheduled_new_reqs
    assert new.num_computed_tokens == 17


def test_a_failed_pull_computes_the_prompt():
    engine, executor = consumer()
    executor.fail_recvs.add("A")
    free = num_free(engine)
    engine.add_request(
        make_request("A", PROMPT, max_tokens=2, kv_transfer_params=pull_params(PROMPT))
    )
    results = run_to_completion(engine)
    assert results["A"][1] == "length"
    scheduled = [so.num_scheduled_tokens for so in executor.outputs if so.num_scheduled_tokens]
    assert scheduled[0] == {"A": 18}
    metadata = [so.kv_connector_metadata for so in executor.outputs if so.kv_connector_metadata]
    assert sum(len(m.recvs) for m in metadata) == 1
    stats = engine.scheduler.get_stats()
    assert (stats.kv_transfer_pulls, stats.kv_transfer_failed_pulls) == (0, 1)
    assert num_free(engine) == free


@pytest.mark.parametrize(
    "overrides",
    [
        {"prompt_hash": prompt_hash([1, 2, 3])},
        {"remote_tp_size": 2},
        {"remote_block_ids": [[11, 12, 13, 14]]},
        {"expires": time.time() - 1},
        {"remote_block_ids": [[0, 0, 13, 14, 15]]},
    ],
    ids=["other prompt", "other tp size", "too few blocks", "ended", "outside a window"],
)
def test_params_that_do_not_fit_compute_the_prompt(overrides):
    engine, executor = consumer()
    params = pull_params(PROMPT, **overrides)
    engine.add_request(make_request("A", PROMPT, max_tokens=1, kv_transfer_params=params))
    engine.step()
    assert executor.outputs[0].num_scheduled_tokens == {"A": 18}
    assert executor.outputs[0].kv_connector_metadata is None


def test_an_abort_while_pulling_frees_the_blocks_once_the_pull_ends():
    engine, executor = consumer()
    free = num_free(engine)
    engine.add_request(make_request("A", PROMPT, kv_transfer_params=pull_params(PROMPT)))
    engine.step()
    engine.abort_requests(["A"])
    assert num_free(engine) == free - 5  # the pull may still write them
    engine.add_request(make_request("A", 4))
    aborted, refused = engine.step().outputs
    assert str(aborted.finish_reason) == "abort"
    assert refused.error is not None and "already in use" in refused.error
    run_to_completion(engine)
    assert num_free(engine) == free
    assert not engine.scheduler.remote_kv.loading


def test_producer_keeps_the_blocks_until_they_are_pulled():
    engine, executor = make_engine(kv_transfer_config=PRODUCER)
    free = num_free(engine)
    params = KVTransferParams(do_remote_decode=True)
    engine.add_request(make_request("P", PROMPT, max_tokens=1, kv_transfer_params=params))
    outputs = engine.step().outputs
    (out,) = outputs
    assert out.finish_reason is not None
    answer = out.kv_transfer_params
    assert answer.do_remote_prefill and not answer.do_remote_decode
    assert answer.remote_block_ids == [[1, 2, 3, 4, 5]]
    assert (answer.remote_host, answer.remote_port, answer.remote_tp_size) == ("10.0.0.7", 20000, 1)
    assert answer.prompt_hash == prompt_hash(PROMPT)
    assert answer.remote_engine_id == engine.config.kv_transfer_config.engine_id
    assert 119 < answer.expires - time.time() < 120.01  # send_timeout_s
    transfer = engine.config.kv_transfer_config
    secret = transfer_secret(shared_credentials(transfer.credentials_path))
    key = transfer_key(
        secret, transfer.engine_id, 20000, answer.transfer_id, [[1, 2, 3, 4, 5]], answer.expires
    )
    assert answer.transfer_key == key
    assert engine.has_unfinished_requests() and num_free(engine) == free - 5
    engine.step()
    (send,) = executor.outputs[-1].kv_connector_metadata.sends
    assert (send.request_id, send.transfer_id) == ("P", answer.transfer_id)
    for _ in range(3):
        engine.step()
    assert engine.has_unfinished_requests() and num_free(engine) == free - 5
    executor.pulled.add("P")
    run_to_completion(engine)
    assert num_free(engine) == free
    assert engine.scheduler.get_stats().kv_transfer_sends == 1


def test_producer_hands_over_only_requests_that_finished_normally():
    engine, executor = make_engine(kv_transfer_config=PRODUCER)
    free = num_free(engine)
    params = KVTransferParams(do_remote_decode=True)
    engine.add_request(make_request("P", PROMPT, max_tokens=5, kv_transfer_params=params))
    engine.step()
    engine.abort_requests(["P"])
    (out,) = engine.step().outputs
    assert out.finish_reason is not None and out.kv_transfer_params is None
    assert num_free(engine) == free and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("role", "params", "message"),
    [
        (None, KVTransferParams(do_remote_decode=True), "--kv-transfer-config"),
        ("kv_consumer", KVTransferParams(do_remote_decode=True), "needs a KV producer"),
        ("kv_producer", pull_params(PROMPT), "needs a KV consumer"),
    ],
)
def test_params_the_instance_cannot_honour_are_refused(role, params, message):
    config = {} if role is None else {"kv_transfer_config": {"kv_role": role}}
    engine, _ = make_engine(**config)
    engine.add_request(make_request("A", PROMPT, kv_transfer_params=params))
    (out,) = engine.step().outputs
    assert out.error is not None and message in out.error


def test_replaced_workers_lose_every_transfer():
    engine, executor = make_engine(kv_transfer_config={**PRODUCER, "kv_role": "kv_both"})
    executor.remote_kv["A"] = PROMPT
    free = num_free(engine)
    engine.add_request(
        make_request("P", PROMPT[::-1], max_tokens=1, kv_transfer_params=KVTransferParams(True))
    )
    engine.step()
    engine.add_request(
        make_request("A", PROMPT, max_tokens=2, kv_transfer_params=pull_params(PROMPT))
    )
    engine.step()
    remote_kv = engine.scheduler.remote_kv
    assert set(remote_kv.held) == {"P"} and set(remote_kv.loading) == {"A"}
    executor.fail_steps.add(executor.outputs[-1].step_id + 1)
    results = run_to_completion(engine)
    assert executor.num_replacements == 1
    assert results["A"][1] == "length"
    assert [so.num_scheduled_tokens for so in executor.outputs if so.num_scheduled_tokens][-2] == {
        "A": 18
    }
    assert num_free(engine) == free


def test_blocks_nobody_pulls_are_freed_and_their_transfer_revoked():
    producer = {**PRODUCER, "kv_connector_extra_config": {"send_timeout_s": 0.05}}
    engine, executor = make_engine(kv_transfer_config=producer)
    free = num_free(engine)
    params = KVTransferParams(do_remote_decode=True)
    engine.add_request(make_request("P", PROMPT, max_tokens=1, kv_transfer_params=params))
    (out,) = engine.step().outputs
    assert num_free(engine) == free - 5
    time.sleep(0.1)
    run_to_completion(engine)
    assert num_free(engine) == free
    metadata = [so.kv_connector_metadata for so in executor.outputs if so.kv_connector_metadata]
    revoked = [transfer_id for m in metadata for transfer_id in m.revoked]
    assert revoked == [out.kv_transfer_params.transfer_id]
    assert engine.scheduler.get_stats().kv_transfer_sends == 1


def test_a_landed_request_that_cannot_run_gives_its_blocks_to_one_that_runs():
    """Blocks held by a request that does not run must not starve one that does."""
    engine, executor = consumer(num_blocks=8, max_model_len=28, max_num_seqs=1)
    free = num_free(engine)  # 7
    engine.add_request(
        make_request("A", PROMPT, max_tokens=2, kv_transfer_params=pull_params(PROMPT))
    )
    engine.step()
    engine.add_request(make_request("L", 4, max_tokens=20, ignore_eos=True))
    engine.step()
    remote_kv = engine.scheduler.remote_kv
    assert [r.request_id for r in remote_kv.ready] == ["A"]  # L runs; max_num_seqs is 1
    assert num_free(engine) == free - 5 - 1
    results = run_to_completion(engine)
    assert results["L"][1] == "length" and results["A"][1] == "length"
    assert num_free(engine) == free
    (new,) = [n for so in executor.outputs for n in so.scheduled_new_reqs if n.req_id == "A"]
    # L's growth took A's blocks back: A was computed again, but for the pulled blocks that
    # were still in the prefix cache (the stand-in checked each one it read).
    assert new.num_computed_tokens < 17
