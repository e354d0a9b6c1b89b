"""Scheduling policy: budgets, chunked prefill, prefix hits, preemption, aborts, priority.

Expected schedules are worked out by hand from the policy in DESIGN §5; the stand-in
executor replays the worker's view of every step and checks it against the KV cache.
"""

from stand_in_executor import collect, make_engine, make_request, run_to_completion

from engine_core import RequestStatus
from ipc.messages import ITERATION_TOKEN_BUCKETS, FinishReason


def position_token(request_id: str, token_ids: list[int]) -> int:
    """The next token depends on the sequence length only: recomputation must agree."""
    return 100 + len(token_ids)


def test_partial_prefills_share_the_budget_with_decodes():
    engine, executor = make_engine(max_num_batched_tokens=32)
    for i, (request_id, length) in enumerate([("A", 50), ("B", 30), ("C", 10)]):
        engine.add_request(make_request(request_id, length, arrival_time=i))
    results: dict[str, list] = {}
    produced = []
    for _ in range(4):
        outputs = engine.step()
        collect(outputs, results)
        produced.append(sorted(o.request_id for o in outputs.outputs))
    steps = [so.num_scheduled_tokens for so in executor.outputs]
    assert steps == [
        {"A": 32},
        {"A": 18, "B": 14},
        {"A": 1, "B": 16, "C": 10},  # a decode, the rest of a prefill and a whole prefill
        {"A": 1, "B": 1, "C": 1},
    ]
    assert produced == [[], ["A"], ["A", "B", "C"], ["A", "B", "C"]]
    third = executor.outputs[2]
    assert [r.req_id for r in third.scheduled_new_reqs] == ["C"]
    assert third.scheduled_cached_reqs.req_ids == ["A", "B"]
    assert third.scheduled_cached_reqs.num_computed_tokens == [50, 14]
    assert third.scheduled_cached_reqs.new_token_ids == [[], []]


def test_chunked_prefill_disabled_keeps_a_prompt_waiting_until_it_fits():
    engine, executor = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=64)
    engine.add_request(make_request("A", 40, arrival_time=0))
    engine.add_request(make_request("B", 30, arrival_time=1))
    engine.add_request(make_request("C", 20, arrival_time=2))
    engine.step()
    engine.step()
    assert [so.num_scheduled_tokens for so in executor.outputs] == [
        {"A": 40},  # B (30) does not fit the 24 left, and C may not overtake it
        {"A": 1, "B": 30, "C": 20},
    ]


def test_max_num_seqs_caps_the_running_requests():
    engine, executor = make_engine(max_num_seqs=2)
    for i in range(3):
        engine.add_request(make_request(f"R{i}", 4, arrival_time=i, max_tokens=2))
    engine.step()
    engine.step()
    assert [so.num_scheduled_tokens for so in executor.outputs] == [
        {"R0": 4, "R1": 4},
        {"R0": 1, "R1": 1},
    ]
    engine.step()
    assert executor.outputs[-1].num_scheduled_tokens == {"R2": 4}
    assert executor.outputs[-1].finished_req_ids == ["R0", "R1"]


def test_prefix_hit_reuses_blocks_and_always_computes_the_last_token():
    engine, executor = make_engine()
    prompt = list(range(1000, 1017))  # 4 full blocks of 4 and one token
    engine.add_request(make_request("A", prompt, max_tokens=1))
    run_to_completion(engine)
    (first_blocks,) = executor.outputs[0].scheduled_new_reqs[0].block_ids

    engine.add_request(make_request("full", prompt, max_tokens=1))
    (output,) = engine.step().outputs
    assert (output.new_token_ids, output.finish_reason, output.num_cached_tokens) == (
        [7],
        FinishReason.LENGTH,
        16,
    )
    new = executor.outputs[-1].scheduled_new_reqs[0]
    assert new.num_computed_tokens == 16
    assert executor.outputs[-1].num_scheduled_tokens == {"full": 1}
    assert new.block_ids[0][:4] == first_blocks[:4]

    engine.add_request(make_request("aligned", prompt[:16], max_tokens=1))
    run_to_completion(engine)
    new = executor.outputs[-1].scheduled_new_reqs[0]
    assert new.num_computed_tokens == 12  # the hit stops short of the last token's block
    assert executor.outputs[-1].num_scheduled_tokens == {"aligned": 4}
    assert new.block_ids[0][:3] == first_blocks[:3]

    stats = engine.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (17 + 17 + 16, 16 + 12)


def test_prefix_caching_disabled_never_hits():
    engine, executor = make_engine(enable_prefix_caching=False)
    prompt = list(range(1000, 1017))
    for request_id in ("A", "B"):
        engine.add_request(make_request(request_id, prompt, max_tokens=1))
        run_to_completion(engine)
    assert executor.outputs[-1].scheduled_new_reqs[0].num_computed_tokens == 0
    assert engine.get_stats().prefix_cache_hits == 0


def run_until_preemption(engine, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        engine.step()
        if engine.get_stats().num_preemptions:
            return
    raise AssertionError("no preemption happened")


def check_resumed(engine, executor, request_id: str) -> None:
    """Run until `request_id` resumes; its entry must carry all its blocks and tokens."""
    request = engine.scheduler.requests[request_id]
    for _ in range(100):
        token_ids = list(request.all_token_ids)
        engine.step()
        cached = executor.outputs[-1].scheduled_cached_reqs
        if request_id in cached.req_ids:
            i = cached.req_ids.index(request_id)
            assert cached.resumed_from_preemption[i]
            assert cached.new_token_ids[i] == token_ids
            assert cached.new_block_ids[i] == engine.kv_cache_manager.get_block_ids(request_id)
            return
    raise AssertionError(f"{request_id} never resumed")


def test_fcfs_preempts_the_last_admitted_request_and_resumes_it_whole():
    # 16 usable blocks of 4 tokens: two requests growing from 24 tokens cannot both finish.
    # max_num_seqs=2 keeps C waiting behind them.
    engine, executor = make_engine(num_blocks=17, max_num_seqs=2, sample=position_token)
    engine.add_request(make_request("A", 24, arrival_time=0, max_tokens=30))
    engine.add_request(make_request("B", 24, arrival_time=1, max_tokens=30))
    engine.add_request(make_request("C", 4, arrival_time=2, max_tokens=1))
    run_until_preemption(engine)
    b = engine.scheduler.requests["B"]
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0
    assert engine.kv_cache_manager.get_block_ids("B") == [[]]
    assert engine.scheduler.running == [engine.scheduler.requests["A"]]
    assert engine.scheduler.waiting.peek() is b  # back at the front, ahead of C
    assert set(executor.outputs[-1].num_scheduled_tokens) == {"A"}  # no admission this step

    a = engine.scheduler.requests["A"]
    check_resumed(engine, executor, "B")
    run_to_completion(engine)
    # Outputs survive preemption: the sequence continues where it stopped.
    assert b.output_token_ids == a.output_token_ids == [100 + 24 + i for i in range(30)]
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert engine.kv_cache_manager.block_pool.get_num_free_blocks() == 16


def test_priority_preempts_the_lowest_priority_even_if_admitted_first():
    engine, executor = make_engine(
        num_blocks=17, max_num_seqs=2, sample=position_token, scheduling_policy="priority"
    )
    engine.add_request(make_request("low", 24, arrival_time=0, priority=1, max_tokens=30))
    engine.step()
    # One block boundary ahead of "low", so "high" runs out of room after "low" was scheduled.
    engine.add_request(make_request("high", 27, arrival_time=1, priority=0, max_tokens=30))
    # "small" waits for a free seat; it would fit in the room the preemption frees.
    engine.add_request(make_request("small", 4, arrival_time=2, priority=0, max_tokens=1))
    run_until_preemption(engine)
    low = engine.scheduler.requests["low"]
    assert low.status == RequestStatus.PREEMPTED
    assert engine.kv_cache_manager.get_block_ids("low") == [[]]
    assert engine.scheduler.requests["high"].num_preemptions == 0
    # The victim gave back the tokens it was scheduled earlier in the step, and nothing
    # was admitted in a step that preempted.
    assert set(executor.outputs[-1].num_scheduled_tokens) == {"high"}
    assert [r.request_id for r in engine.scheduler.waiting] == ["small", "low"]
    check_resumed(engine, executor, "low")
    run_to_completion(engine)
    assert low.output_token_ids == [100 + 24 + i for i in range(30)]
    assert engine.get_stats().num_preemptions == 1


def test_priority_orders_the_waiting_queue():
    def admission_order(policy: str) -> list[str]:
        engine, executor = make_engine(max_num_seqs=1, scheduling_policy=policy)
        for request_id, priority, arrival in [("C", 2, 0), ("A", 0, 2), ("B", 0, 1), ("D", 1, 0)]:
            engine.add_request(make_request(request_id, 4, arrival, priority, max_tokens=2))
        run_to_completion(engine)
        return [r.req_id for so in executor.outputs for r in so.scheduled_new_reqs]

    assert admission_order("priority") == ["B", "A", "D", "C"]
    assert admission_order("fcfs") == ["C", "A", "B", "D"]


def test_abort_waiting_running_and_preempted_requests():
    engine, executor = make_engine(num_blocks=17)
    engine.add_request(make_request("A", 24, arrival_time=0, max_tokens=30))
    engine.add_request(make_request("B", 24, arrival_time=1, max_tokens=30))
    run_until_preemption(engine)
    engine.add_request(make_request("W", 4, arrival_time=2))
    assert engine.scheduler.requests["B"].status == RequestStatus.PREEMPTED
    engine.abort_requests(["W", "B", "unknown"])
    engine.abort_requests(["A"])
    assert engine.kv_cache_manager.block_pool.get_num_free_blocks() == 16
    assert not engine.scheduler.running and not engine.scheduler.waiting
    results = run_to_completion(engine)
    assert results == {r: [[], "abort"] for r in ("W", "B", "A")}
    assert all("W" not in so.num_scheduled_tokens for so in executor.outputs)

    # Nothing ran since the aborts: their ids reach the workers with the next real step.
    num_steps = len(executor.outputs)
    engine.add_request(make_request("next", 4, max_tokens=1))
    engine.step()
    assert len(executor.outputs) == num_steps + 1
    assert sorted(executor.outputs[-1].finished_req_ids) == ["A", "B", "W"]
    assert executor.states.keys() == {"next"}


def test_aborting_a_finished_request_changes_nothing():
    engine, _ = make_engine()
    engine.add_request(make_request("A", 4, max_tokens=1))
    assert run_to_completion(engine) == {"A": [[7], "length"]}
    engine.abort_requests(["A"])
    assert not engine.has_unfinished_requests()


def test_idle_step_does_not_call_the_executor():
    engine, executor = make_engine()
    assert engine.step().outputs == []
    assert executor.outputs == []


def test_stats_count_requests_tokens_and_kv_usage():
    engine, _ = make_engine(num_blocks=33, max_num_seqs=2)
    for i in range(3):
        engine.add_request(make_request(f"R{i}", 10, arrival_time=i, max_tokens=3))
    engine.step()
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    assert stats.kv_cache_usage == 6 / 32  # 3 blocks of 4 tokens for each running prompt
    assert stats.num_prompt_tokens == 20 and stats.num_generation_tokens == 2
    run_to_completion(engine)
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.num_prompt_tokens == 30 and stats.num_generation_tokens == 9
    assert stats.prefix_cache_queries == 30 and stats.num_preemptions == 0


def test_a_preempted_request_reports_its_preemptions_when_it_finishes():
    engine, _ = make_engine(num_blocks=17, max_num_seqs=2, sample=position_token)
    engine.add_request(make_request("A", 24, arrival_time=0, max_tokens=30))
    engine.add_request(make_request("B", 24, arrival_time=1, max_tokens=30))
    preemptions = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finish_reason is not None:
                preemptions[out.request_id] = out.request_stats.num_preemptions
    assert preemptions["A"] == 0 and preemptions["B"] >= 1
    assert sum(preemptions.values()) == engine.get_stats().num_preemptions


def test_iteration_tokens_count_each_step_in_its_bucket():
    engine, executor = make_engine(max_num_batched_tokens=16)
    # Steps of 16, 16, 8 + 3 (long's last chunk beside short's prompt), 2 and 1 decodes.
    engine.add_request(make_request("long", 40, max_tokens=3))
    engine.add_request(make_request("short", 3, max_tokens=2))
    run_to_completion(engine)
    totals = [o.total_num_scheduled_tokens for o in executor.outputs]
    totals = [t for t in totals if t]
    assert totals == [16, 16, 11, 2, 1]
    stats = engine.get_stats()
    want = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    for total in totals:
        want[next(i for i, b in enumerate(ITERATION_TOKEN_BUCKETS) if total <= b)] += 1
    assert stats.iteration_tokens == want and stats.iteration_tokens_sum == sum(totals) == 46
