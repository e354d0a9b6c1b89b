"""Speculative decoding in the EngineCore: prompt-lookup drafts, 1 + k tokens scheduled per
speculating request, the rollback of rejected drafts, the gate that pauses speculation,
lockstep under async scheduling, and the spec_decode counters, over the stand-in workers
(which verify drafts against their scripted token stream)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stand_in_executor import make_engine, make_request, run_to_completion

from engine_core.ngram_proposer import NgramProposer
from engine_core.spec_decode import DraftModelProposals
from engine_core.spec_gate import SpeculationGate
from ipc.config import EngineConfig
from ipc.spec_config import SpeculativeConfig


def reference_drafts(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix of length min_n..max_n that occurs earlier; its latest earlier
    occurrence's continuation."""
    size = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= size:
            continue
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=40),
    k=st.integers(1, 5),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    grow=st.lists(st.integers(0, 4), max_size=6),
)
def test_ngram_proposer_matches_the_reference(tokens, k, min_n, extra, grow):
    proposer = NgramProposer(k, min_n, min_n + extra)
    assert proposer.propose("r", tokens, k) == reference_drafts(tokens, k, min_n, min_n + extra)
    tokens = tokens + grow  # the mirror appends what is new
    assert proposer.propose("r", tokens, k) == reference_drafts(tokens, k, min_n, min_n + extra)
    assert proposer.propose("r", tokens, 1) == reference_drafts(tokens, 1, min_n, min_n + extra)


def test_ngram_proposer_prefers_the_longest_then_the_latest_match():
    proposer = NgramProposer(3, 1, 3)
    # "2 3" occurs twice before the end; "1 2 3" once (followed by 9).
    tokens = [1, 2, 3, 9, 8, 2, 3, 7, 7, 1, 2, 3]
    assert proposer.propose("a", tokens, 3) == [9, 8, 2]
    tokens = [5, 2, 3, 9, 4, 2, 3, 7, 6, 1, 2, 3]
    assert proposer.propose("b", tokens, 3) == [7, 6, 1]  # the later "2 3"
    assert proposer.propose("c", [1, 2, 3, 4], 3) == []
    assert proposer.propose("d", [1, 2, 1, 2], 0) == []


def spec_engine(k=3, script=None, **kwargs):
    spec = {"num_speculative_tokens": k, "prompt_lookup_min": 1, "adaptive": False}
    spec.update(kwargs.pop("spec", {}))
    kwargs.setdefault("max_model_len", 160)
    return make_engine(script=script, speculative_config=spec, **kwargs)


def test_a_verification_step_schedules_the_drafts_and_rolls_back_the_rejected():
    # Prompt 1 2 3 4 1 2: after the prefill samples 3, the suffix "1 2 3" proposes 4 1 2.
    # The script continues 3 4 1 5: two drafts accepted, the third (2) rejected for 5.
    engine, executor = spec_engine(3, script={"r": [3, 4, 1, 5, 9, 9, 9, 9]})
    engine.add_request(make_request("r", [1, 2, 3, 4, 1, 2], max_tokens=8))
    engine.step()  # prefill
    request = engine.scheduler.requests["r"]
    assert request.output_token_ids == [3] and request.num_computed_tokens == 6
    engine.step()
    so = executor.outputs[-1]
    assert so.scheduled_spec_decode_tokens == {"r": [4, 1, 2]}
    assert so.num_scheduled_tokens == {"r": 4}
    assert request.output_token_ids == [3, 4, 1, 5]
    # Positions 6 (token 3), 7 (4), 8 (1) computed; 9 held the rejected draft 2.
    assert request.num_computed_tokens == 9 == request.num_tokens - 1
    stats = engine.get_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (1, 3)
    assert stats.spec_decode_num_accepted_tokens == 2
    assert stats.spec_decode_num_accepted_tokens_per_pos == [1, 1, 0]
    engine.step()
    so = executor.outputs[-1]
    assert so.scheduled_cached_reqs.num_computed_tokens == [9]
    assert so.num_scheduled_tokens["r"] == 1 + len(so.scheduled_spec_decode_tokens.get("r", []))


def test_drafts_respect_max_tokens_max_model_len_and_the_budget():
    engine, executor = spec_engine(4, script={"r": [5, 6, 5, 6, 5, 6, 5, 6]})
    engine.add_request(make_request("r", [5, 6, 5, 6, 5, 6], max_tokens=3))
    results = run_to_completion(engine)
    assert results["r"] == [[5, 6, 5], "length"]
    # One token from the prefill: the verification may propose at most 2 - 1 drafts.
    assert [so.scheduled_spec_decode_tokens for so in executor.outputs[1:]] == [{"r": [6]}]

    engine, executor = spec_engine(4, max_model_len=10, script={"r": [5, 6, 5, 6]})
    engine.add_request(make_request("r", [5, 6, 5, 6, 5, 6], max_tokens=None))
    assert run_to_completion(engine)["r"] == [[5, 6, 5, 6], "length"]
    for so in executor.outputs:
        for request_id, drafts in so.scheduled_spec_decode_tokens.items():
            cached = so.scheduled_cached_reqs
            computed = cached.num_computed_tokens[cached.req_ids.index(request_id)]
            assert computed + 1 + len(drafts) <= 10

    engine, executor = spec_engine(4, max_num_batched_tokens=3, script={"r": [5, 6] * 4})
    engine.add_request(make_request("r", [5, 6, 5], max_tokens=8))
    run_to_completion(engine)
    assert max(so.total_num_scheduled_tokens for so in executor.outputs) <= 3
    assert any(so.scheduled_spec_decode_tokens for so in executor.outputs)


def draft_model_engine(k=3, draft=None, **kwargs):
    spec = {"method": "draft_model", "model": "-", "num_speculative_tokens": k}
    spec["adaptive"] = False
    engine, executor = make_engine(speculative_config=spec, **{"max_model_len": 160, **kwargs})
    executor.draft = draft
    return engine, executor


def test_a_draft_models_proposals_are_verified_in_the_next_step():
    # The script: 10 11 12 13 14 ...; the stand-in draft model is right but for 3rd drafts.
    script = {"r": list(range(10, 40))}

    def draft(request_id, token_ids):
        n = len(token_ids) - 4  # outputs so far
        return [10 + n, 11 + n, 99]

    engine, executor = draft_model_engine(3, draft, script=script)
    engine.add_request(make_request("r", [1, 2, 3, 4], max_tokens=9))
    engine.step()  # prefill: samples 10, then the draft model proposes 11 12 99
    first = executor.outputs[0]
    assert first.propose_drafts and first.lockstep
    assert not first.scheduled_spec_decode_tokens
    request = engine.scheduler.requests["r"]
    # Lookahead: 4 prompt tokens + 3 slots for the draft model = 2 blocks of 4.
    assert len(engine.kv_cache_manager.get_block_ids("r")[0]) == 2
    engine.step()
    so = executor.outputs[-1]
    assert so.scheduled_spec_decode_tokens == {"r": [11, 12, 99]}
    assert so.num_scheduled_tokens == {"r": 4}
    assert request.output_token_ids == [10, 11, 12, 13]
    assert request.num_computed_tokens == request.num_tokens - 1 == 7
    results = run_to_completion(engine)
    assert results["r"] == [list(range(10, 19))[4:], "length"]
    assert request.output_token_ids == list(range(10, 19))
    stats = engine.get_stats()
    # 11 12 99, 14 15 99, then max_tokens leaves room for one draft (17).
    assert stats.spec_decode_num_draft_tokens == 7
    assert stats.spec_decode_num_accepted_tokens_per_pos == [3, 2, 0]
    assert engine.kv_cache_manager.usage == 0.0


def test_a_draft_models_proposals_hold_only_for_the_tokens_they_follow():
    proposals = DraftModelProposals()
    proposals.store("r", 5, [1, 2, 3])
    assert proposals.propose("r", [0] * 6, 3) == []  # the request moved on without them
    proposals.store("r", 5, [1, 2, 3])
    assert proposals.propose("r", [0] * 5, 2) == [1, 2]
    assert proposals.propose("r", [0] * 5, 2) == []  # used once
    proposals.store("r", 5, [1, 2, 3])
    proposals.free("r")
    assert proposals.propose("r", [0] * 5, 3) == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_draft_model_gives_the_tokens_of_plain_decoding(async_scheduling):
    """Greedy streams, preemption (few blocks) and prefix hits: a draft that is wrong now
    and then changes nothing but the number of steps."""
    script = {f"r{i}": [(7 * i + 3 * j) % 50 + 3 for j in range(20)] for i in range(4)}

    def draft(request_id, token_ids):
        stream = script[request_id]
        n = len(token_ids) - 6
        return [stream[n + j] if (n + j) % 3 else 1 for j in range(3) if n + j < len(stream)]

    def run(spec):
        kw = dict(num_blocks=20, async_scheduling=async_scheduling, enable_prefix_caching=True)
        kw["max_model_len"] = 32
        if spec:
            engine, executor = draft_model_engine(3, draft, script=script, **kw)
        else:
            engine, executor = make_engine(script=script, **kw)
        for i in range(4):
            engine.add_request(make_request(f"r{i}", [1, 2, 3, 4, 5, i], max_tokens=18))
        return engine, executor, run_to_completion(engine)

    plain = run(False)[2]
    engine, executor, speculative = run(True)
    assert speculative == plain
    stats = engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for so in executor.outputs:
        assert so.lockstep


class StepClock:
    """A fake clock for the gate: a step of n tokens takes 1 + (n - 1) / 4 time units (the
    extra tokens cost a quarter each, as on a device that is mostly weight-bound)."""

    def __init__(self, executor):
        self.now = 0.0
        run = executor.execute_model

        def timed(so):
            self.now += 1 + (so.total_num_scheduled_tokens - 1) / 4
            return run(so)

        executor.execute_model = timed

    def __call__(self) -> float:
        return self.now


def gated_engine(script, k=3, **kwargs):
    engine, executor = spec_engine(k, script=script, spec={"adaptive": True}, **kwargs)
    engine.scheduler.spec.gate.clock = StepClock(executor)
    return engine, executor


def test_the_gate_keeps_drafts_that_pay():
    # The output repeats the prompt's 5 6 7 8: every draft is accepted.
    engine, executor = gated_engine({"r": [5, 6, 7, 8] * 40})
    engine.add_request(make_request("r", [5, 6, 7, 8] * 2, max_tokens=150, ignore_eos=True))
    run_to_completion(engine)
    state = engine.scheduler.spec.gate.buckets[1]
    assert state.last_winner is True and state.run_length > 16
    with_drafts = [bool(so.scheduled_spec_decode_tokens) for so in executor.outputs[1:]]
    assert sum(with_drafts) > 0.6 * len(with_drafts)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_gate_turns_off_drafts_that_do_not_pay(async_scheduling):
    # 5 recurs, but never followed by what followed it before: every draft is rejected.
    script = {"r": [t for i in range(100, 180) for t in (5, i)]}
    engine, executor = gated_engine(script, async_scheduling=async_scheduling)
    engine.add_request(make_request("r", [5, 6, 5, 6, 5], max_tokens=150, ignore_eos=True))
    run_to_completion(engine)
    state = engine.scheduler.spec.gate.buckets[1]
    assert state.last_winner is False and state.run_length > 16
    steps = executor.outputs[1:]
    with_drafts = [i for i, so in enumerate(steps) if so.scheduled_spec_decode_tokens]
    # 8 plain steps, then drafts (every other step finds one) at 0.47x the plain rate for
    # as long: 8.5 time units, 1.5 lost. The run of plain steps lasts until that is 2 % of
    # it (75 steps), then a second measurement: two windows of 3 or 4 steps with drafts.
    first = [i for i in with_drafts if i < 75]
    assert first[0] == (10 if async_scheduling else 8)  # after the plain window
    assert len(first) <= 4 and len(with_drafts) <= 8
    if async_scheduling:
        assert sum(so.lockstep for so in steps) <= 2 * 8  # plain steps overlap again


def test_each_batch_size_bucket_is_measured_on_its_own():
    script = {"a": [5] + list(range(100, 200))}
    engine, executor = gated_engine(script, k=2, max_num_seqs=8)
    gate = engine.scheduler.spec.gate
    engine.add_request(make_request("a", [5, 6, 5, 6], max_tokens=60, ignore_eos=True))
    for _ in range(30):
        engine.step()
    alone = gate.buckets[1]
    assert not alone.measuring and alone.mode is False
    for name in "bcd":
        engine.add_request(make_request(name, [9, 9, 9, 9], max_tokens=3, ignore_eos=True))
    engine.step()
    # Drafts did not pay for one request: four start without them, in a run.
    assert set(gate.buckets) == {1, 4} and not gate.buckets[4].measuring
    assert not gate.speculates(4) and not gate.speculates(1)
    run_to_completion(engine)
    assert gate.buckets[1] is alone  # back alone: its run goes on


def test_a_new_bucket_is_measured_unless_a_neighbour_decides_it():
    gate = SpeculationGate(SpeculativeConfig())
    assert not gate.speculates(1) and gate.buckets[1].measuring  # plain steps first
    gate.buckets[1].start_run(True)
    assert gate.bucket(8).measuring  # larger: measure it
    gate.buckets[8].start_run(False, 300)
    assert not gate.speculates(40) and not gate.buckets[32].measuring  # a smaller lost
    assert gate.buckets[32].run_left == 300  # as long as its run
    assert gate.bucket(2).measuring  # none lost below, none won above
    gate = SpeculationGate(SpeculativeConfig())
    gate.bucket(40).start_run(True)
    assert gate.speculates(3) and not gate.buckets[4].measuring  # a larger won


def measured_gate():
    """A gate whose bucket 64 has measured 8 plain steps of 1 s and 64 tokens each."""
    clock = [0.0]
    gate = SpeculationGate(SpeculativeConfig(), clock=lambda: clock[0])
    step_id = 0

    def step(seconds, num_tokens, mostly_prefill=False):
        nonlocal step_id
        speculated = gate.speculates(64)
        gate.step_scheduled(step_id, 64, speculated, mostly_prefill)
        clock[0] += seconds
        gate.step_answered(step_id, num_tokens)
        step_id += 1
        return speculated

    assert [step(1.0, 64) for _ in range(8)] == [False] * 8
    return gate, gate.buckets[64], step


def test_drafts_that_cost_several_plain_steps_are_measured_for_as_long_as_plain_ones():
    gate, state, step = measured_gate()
    # A step with drafts takes 4.5 plain ones and generates 3.1x the tokens.
    assert step(4.5, 200) and step(4.5, 200)
    # 9 s >= the plain window's 8 s: 44 tok/s lost to 64. The drafts' 400 tokens would
    # have taken 6.25 s: 2.75 s lost, 2 % of a run of 137 plain steps.
    assert not state.measuring and state.mode is False and state.run_length == 137
    assert not any(step(1.0, 64) for _ in range(137))
    assert state.measuring and not step(1.0, 64)
    # The same verdict again: the run doubles.
    for _ in range(7):
        step(1.0, 64)
    step(4.5, 200)
    step(4.5, 200)
    assert state.mode is False and state.run_length == 274


def test_modes_that_measure_close_are_measured_again_soon():
    gate, state, step = measured_gate()
    assert all(step(1.0, 66) for _ in range(8))
    assert state.mode is True and state.run_length == 16


def test_steps_that_mostly_prefill_are_left_out_of_a_window_unless_they_keep_coming():
    gate = SpeculationGate(SpeculativeConfig(), clock=lambda: 0.0)
    state = gate.bucket(64)
    for step_id in range(8):
        gate.step_scheduled(step_id, 64, False, mostly_prefill=True)
        gate.step_answered(step_id, 1)
    assert state.skipped == 8 and state.measured[False][2] == 0
    gate.step_scheduled(8, 64, False, mostly_prefill=True)
    gate.step_answered(8, 1)
    assert state.measured[False][2] == 1  # a steady stream of prompts: counted now


def test_an_engines_prefill_steps_are_left_out_of_the_gates_window():
    engine, executor = gated_engine({"r": list(range(100, 140))}, max_num_batched_tokens=4)
    engine.add_request(make_request("r", [5, 6] * 5, max_tokens=8, ignore_eos=True))
    for _ in range(3):  # 4 + 4 + 2 prompt tokens
        engine.step()
    state = engine.scheduler.spec.gate.buckets[1]
    assert state.skipped == 3 and state.measured[False][2] == 0
    engine.step()  # one decoding request
    assert state.skipped == 3 and state.measured[False][2] == 1


def test_a_batch_held_at_a_power_of_two_stays_in_its_bucket():
    gate = SpeculationGate(SpeculativeConfig())
    assert gate.bucket(63) is gate.bucket(64) is gate.bucket(90)
    assert gate.bucket(45) is not gate.bucket(46)
    assert [n for n in range(1, 13) if gate.bucket(n) is gate.bucket(4)] == [3, 4, 5]


def test_without_adaptive_every_step_may_speculate():
    engine, executor = spec_engine(2, script={"r": list(range(100, 140))})
    engine.add_request(make_request("r", [5, 6, 5, 6, 5], max_tokens=40, ignore_eos=True))
    run_to_completion(engine)
    assert all(so.lockstep for so in executor.outputs)
    assert not engine.scheduler.spec.gate.buckets  # never judged


def test_disable_by_batch_size_turns_drafts_off_while_more_requests_run():
    engine, executor = spec_engine(2, spec={"disable_by_batch_size": 1})
    for name in "abc":
        engine.add_request(make_request(name, [7, 7, 7, 7], max_tokens=6))
    run_to_completion(engine)
    for so in executor.outputs:
        if so.scheduled_spec_decode_tokens:
            assert len(so.num_scheduled_tokens) == 1


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_speculating_steps_run_in_lockstep_and_match_plain_decoding(async_scheduling):
    prompts = {"a": [3, 1, 3, 1, 3], "b": [4, 4, 4], "c": [1, 2, 3, 4, 5, 6]}

    def sample(request_id, token_ids):
        return [1, 3, 4][len(token_ids) % 3] if request_id != "c" else len(token_ids) % 5

    def run(spec):
        kwargs = {"speculative_config": spec} if spec else {}
        engine, executor = make_engine(
            sample=sample, async_scheduling=async_scheduling, max_model_len=40, **kwargs
        )
        for name, prompt in prompts.items():
            engine.add_request(make_request(name, prompt, max_tokens=20, ignore_eos=True))
        return engine, executor, run_to_completion(engine)

    _, _, plain = run(None)
    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    engine, executor, speculative = run(spec)
    assert speculative == plain
    assert engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert len(executor.outputs) < sum(len(t) for t, _ in plain.values())
    for so in executor.outputs:
        if so.scheduled_spec_decode_tokens:
            assert so.lockstep


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "medusa"}, "not available yet"),
        ({"method": "eagle3"}, "not available yet"),
        ({"method": "draft_model"}, "draft_model needs a model"),
        ({"model": "x"}, "only draft_model takes one"),
        ({"method": "draft_model", "model": "x", "prompt_lookup_min": 2}, "only apply to"),
        ({"method": "nope"}, "unknown method 'nope'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"num_speculative_tokens": 17}, "<= 16"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max must be"),
        ({"lookahead": 2}, "unknown key(s) lookahead"),
        ("{not json", "not valid JSON"),
        ({"adaptive": 1}, "adaptive must be true or false"),
    ],
)
def test_bad_speculative_configs_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(max_model_len=16, speculative_config=value)


def test_a_speculative_config_crosses_processes_as_json():
    import dataclasses
    import json

    config = EngineConfig(max_model_len=16, speculative_config='{"num_speculative_tokens": 5}')
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=5)
    copy = EngineConfig(**json.loads(json.dumps(dataclasses.asdict(config))))
    assert copy.speculative_config == config.speculative_config
    assert copy.num_speculative_tokens == 5
