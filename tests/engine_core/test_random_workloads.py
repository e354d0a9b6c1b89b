"""Random workloads: arrivals over time, shared prefixes, KV pools small enough to force
preemption, random aborts, workers that fail and are replaced, with and without a host
tier (swap preemption, spills and host hits, under the stand-in's content model), with
and without async scheduling (the stand-in runs a step when it is collected), with and
without speculative decoding (ngram drafts, or a stand-in draft model that is right but
now and then, verified against the token stream), with and without prefill/decode
disaggregation (requests whose prompt KV is pulled, or whose pull fails, and requests whose
blocks are kept for a consumer). Every
request must finish exactly once with exactly the tokens and finish reason its token stream
implies, and both tiers of the KV cache must end empty."""

import time
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stand_in_executor import collect, make_engine, pull_params

from ipc.kv_transfer import KVTransferParams
from ipc.messages import EngineCoreRequest
from ipc.sampling_params import SamplingParams

EOS = 2
MAX_MODEL_LEN = 32


def sample(request_id: str, token_ids: list[int]) -> int:
    return (len(token_ids) * 7 + zlib.crc32(request_id.encode())) % 13


def draft(request_id: str, token_ids: list[int]) -> list[int]:
    """Three drafts that follow the stream, but every fourth position is one off."""
    tokens = list(token_ids)
    for _ in range(3):
        token = sample(request_id, tokens)
        tokens.append(token if len(tokens) % 4 else (token + 1) % 13)
    return tokens[len(token_ids) :]


def expected_output(request_id: str, num_prompt: int, sp: SamplingParams) -> tuple[list, str]:
    """The spec of the stop conditions, applied to the stand-in's token stream."""
    stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {EOS})
    tokens: list[int] = []
    while True:
        tokens.append(sample(request_id, [0] * (num_prompt + len(tokens))))
        if len(tokens) > sp.min_tokens and tokens[-1] in stop_ids:
            return tokens, "stop"
        if len(tokens) == sp.max_tokens or num_prompt + len(tokens) == MAX_MODEL_LEN:
            return tokens, "length"


request_strategy = st.fixed_dictionaries(
    {
        "arrival_step": st.integers(0, 20),
        "prefix": st.integers(0, 2),
        "suffix": st.lists(st.integers(3, 12), max_size=20),
        "max_tokens": st.one_of(st.none(), st.integers(1, 12)),
        "min_tokens": st.integers(0, 3),
        "stop_token_ids": st.lists(st.integers(0, 12), max_size=2),
        "ignore_eos": st.booleans(),
        "priority": st.integers(0, 2),
        "abort_step": st.one_of(st.none(), st.integers(0, 30)),
        "remote": st.sampled_from([None, "pull", "failed pull", "keep"]),
    }
)


@pytest.fixture(scope="module")
def kv_transfer_config(tmp_path_factory) -> dict:
    path = str(tmp_path_factory.mktemp("kv") / "kv.credentials")
    return {"kv_role": "kv_both", "kv_connector_extra_config": {"credentials": path}}


def kv_transfer_params(remote: str | None, prompt: list[int]) -> KVTransferParams | None:
    if remote == "keep":
        return KVTransferParams(do_remote_decode=True)
    if remote is None:
        return None
    block_ids = [list(range(1, MAX_MODEL_LEN + 1))]
    return pull_params(prompt, remote_block_ids=block_ids, expires=time.time() + 3600)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([2, 4]),
    extra_blocks=st.integers(0, 6),
    chunked=st.booleans(),
    budget=st.integers(4, 48),
    max_num_seqs=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    prefixes=st.lists(st.lists(st.integers(3, 12), max_size=16), min_size=3, max_size=3),
    specs=st.lists(request_strategy, min_size=1, max_size=12),
    fail_steps=st.sets(st.integers(0, 40), max_size=3),
    num_host_blocks=st.sampled_from([0, 3, 8, 24]),
    preemption_mode=st.sampled_from(["auto", "swap", "recompute"]),
    costs=st.sampled_from([(1e-6, 1e-4), (1e-3, 1e-5)]),
    async_scheduling=st.booleans(),
    speculation=st.sampled_from(
        [
            None,
            {"num_speculative_tokens": 2, "prompt_lookup_min": 1, "adaptive": False},
            {"num_speculative_tokens": 4, "prompt_lookup_min": 2},
            {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 2},
            {"method": "draft_model", "model": "-", "num_speculative_tokens": 3, "adaptive": False},
            {"method": "draft_model", "model": "-", "num_speculative_tokens": 2},
        ]
    ),
    disaggregation=st.booleans(),
)
def test_random_workloads_finish_every_request_once_and_free_every_block(
    kv_transfer_config,
    block_size,
    extra_blocks,
    chunked,
    budget,
    max_num_seqs,
    policy,
    caching,
    prefixes,
    specs,
    fail_steps,
    num_host_blocks,
    preemption_mode,
    costs,
    async_scheduling,
    speculation,
    disaggregation,
):
    num_blocks = MAX_MODEL_LEN // block_size + 1 + extra_blocks
    engine, executor = make_engine(
        num_blocks,
        sample=sample,
        num_host_blocks=num_host_blocks,
        costs=costs,
        preemption_mode=preemption_mode,
        async_scheduling=async_scheduling,
        max_model_len=MAX_MODEL_LEN,
        block_size=block_size,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget if chunked else max(budget, MAX_MODEL_LEN),
        max_num_seqs=max_num_seqs,
        scheduling_policy=policy,
        enable_prefix_caching=caching,
        eos_token_ids=[EOS],
        max_worker_restarts=len(fail_steps),
        speculative_config=speculation,
        kv_transfer_config=kv_transfer_config if disaggregation else None,
    )
    executor.fail_steps = fail_steps
    executor.draft = draft
    requests = {}
    for i, spec in enumerate(specs):
        prompt = prefixes[spec["prefix"]] + spec["suffix"]
        remote = spec["remote"] if disaggregation else None
        sp = SamplingParams(
            max_tokens=spec["max_tokens"],
            min_tokens=min(spec["min_tokens"], spec["max_tokens"] or 3),
            stop_token_ids=spec["stop_token_ids"],
            ignore_eos=spec["ignore_eos"],
            kv_transfer_params=kv_transfer_params(remote, prompt),
        )
        executor.remote_kv[f"r{i}"] = prompt
        executor.pulled.add(f"r{i}")  # a kept request's blocks are pulled a step later
        if remote == "failed pull":
            executor.fail_recvs.add(f"r{i}")
        requests[f"r{i}"] = EngineCoreRequest(
            f"r{i}", prompt, sp, float(spec["arrival_step"]), spec["priority"]
        )

    results: dict[str, list] = {}
    aborted = set()
    last_arrival = max(spec["arrival_step"] for spec in specs)
    for step in range(1000):
        for (request_id, request), spec in zip(requests.items(), specs, strict=True):
            if spec["arrival_step"] == step:
                engine.add_request(request)
            if spec["abort_step"] == step and spec["arrival_step"] <= step:
                if request_id not in results or results[request_id][1] is None:
                    aborted.add(request_id)
                engine.abort_requests([request_id])
        if step > last_arrival and not engine.has_unfinished_requests():
            break
        collect(engine.step(), results)
        if executor.outputs:
            so = executor.outputs[-1]
            assert so.total_num_scheduled_tokens <= engine.config.max_num_batched_tokens
        assert len(engine.scheduler.running) <= max_num_seqs
    else:
        raise AssertionError("the engine did not drain")

    assert results.keys() == requests.keys()
    for request_id, (tokens, reason) in results.items():
        request = requests[request_id]
        num_prompt = len(request.prompt_token_ids)
        sp = request.sampling_params
        num_output = sp.max_tokens or max(1, sp.min_tokens)
        if num_prompt == 0 or num_prompt + num_output > MAX_MODEL_LEN:
            assert (tokens, reason) == ([], "error")
            continue
        full_tokens, full_reason = expected_output(request_id, num_prompt, sp)
        if request_id in aborted:
            assert reason == "abort" and full_tokens[: len(tokens)] == tokens
        else:
            assert (tokens, reason) == (full_tokens, full_reason)

    assert executor.num_replacements == executor.num_failures
    kv = engine.kv_cache_manager
    for pool in (kv.block_pool, kv.host_block_pool) if num_host_blocks else (kv.block_pool,):
        assert pool.get_num_free_blocks() == pool.num_blocks - 1
        assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    if disaggregation:
        assert not engine.scheduler.remote_kv.has_requests
