import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ipc.messages import NewRequestData
from ipc.sampling_params import SamplingParams
from worker.input_batch import CachedRequestState, InputBatch

MAX_REQS, MAX_MODEL_LEN, MAX_BLOCKS, BLOCK_SIZE, VOCAB = 5, 24, 6, 4, 50

sampling_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0]),
    top_p=st.sampled_from([1.0, 0.9]),
    top_k=st.sampled_from([-1, 0, 3, VOCAB]),
    min_p=st.sampled_from([0.0, 0.1]),
    seed=st.one_of(st.none(), st.integers(0, 2**32)),
    logprobs=st.one_of(st.none(), st.integers(0, 5)),
    frequency_penalty=st.sampled_from([0.0, 0.0, 0.5]),
    logit_bias=st.sampled_from([{}, {}, {3: 1.0}]),
    allowed_token_ids=st.sampled_from([None, None, [1, 4]]),
)


NUM_GROUPS = 2  # KV cache groups: every block table row is kept per group


def make_batch(num_groups: int = 1) -> InputBatch:
    return InputBatch(MAX_REQS, MAX_MODEL_LEN, MAX_BLOCKS, BLOCK_SIZE, "cpu", VOCAB, (), num_groups)


def new_request(req_id, prompt, params, block_ids=None, num_computed=0) -> CachedRequestState:
    block_ids = [[]] if block_ids is None else [list(ids) for ids in block_ids]
    new = NewRequestData(req_id, list(prompt), params, block_ids, num_computed)
    return CachedRequestState.from_new_request(new, "cpu")


class InputBatchMachine(RuleBasedStateMachine):
    """The batch against a model: the model runner's request states and which are in it."""

    def __init__(self):
        super().__init__()
        self.batch = make_batch(NUM_GROUPS)
        self.states: dict[str, CachedRequestState] = {}
        self.in_batch: set[str] = set()
        self.next_id = 0

    def lowest_free_row(self) -> int:
        rows = self.batch.req_ids
        return rows.index(None) if None in rows else len(rows)

    def add(self, state: CachedRequestState) -> None:
        expected_row = self.lowest_free_row()
        assert self.batch.add_request(state) == expected_row
        self.in_batch.add(state.req_id)

    @precondition(lambda self: len(self.in_batch) < MAX_REQS)
    @rule(
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
        params=sampling_params,
        num_blocks=st.integers(0, 3),
    )
    def add_new(self, prompt, params, num_blocks):
        req_id = f"r{self.next_id}"
        self.next_id += 1
        block_ids = [
            [self.next_id * 100 + 10 * g + i for i in range(num_blocks + g)]
            for g in range(NUM_GROUPS)
        ]
        state = new_request(req_id, prompt, params, block_ids, len(prompt) - 1)
        self.states[req_id] = state
        self.add(state)

    @precondition(lambda self: len(self.in_batch) < MAX_REQS)
    @rule(data=st.data())
    def re_add(self, data):
        outside = sorted(set(self.states) - self.in_batch)
        if outside:
            self.add(self.states[data.draw(st.sampled_from(outside))])

    @rule(data=st.data(), finish=st.booleans())
    def remove(self, data, finish):
        if not self.in_batch:
            assert self.batch.remove_request("missing") is None
            return
        req_id = data.draw(st.sampled_from(sorted(self.in_batch)))
        row = self.batch.req_id_to_index[req_id]
        assert self.batch.remove_request(req_id) == row
        self.in_batch.discard(req_id)
        if finish:
            del self.states[req_id]

    @rule()
    def condense(self):
        self.batch.condense()
        assert self.batch.req_ids == [r for r in self.batch.req_ids if r is not None]

    @rule(data=st.data(), token=st.integers(0, VOCAB - 1), new_blocks=st.integers(0, 1))
    def decode_step(self, data, token, new_blocks):
        """What the model runner does for a scheduled request: new blocks, a sampled token
        (drawn from the row's generator for seeded requests), more computed tokens."""
        candidates = [r for r in sorted(self.in_batch) if self.states[r].num_tokens < MAX_MODEL_LEN]
        if not candidates:
            return
        state = self.states[data.draw(st.sampled_from(candidates))]
        row = self.batch.req_id_to_index[state.req_id]
        if max(len(ids) for ids in state.block_ids) + new_blocks <= MAX_BLOCKS:
            new_ids = [
                [9000 + 10 * g + len(ids)] * new_blocks for g, ids in enumerate(state.block_ids)
            ]
            self.batch.block_table.append_row(new_ids, row)
            for ids, added in zip(state.block_ids, new_ids, strict=True):
                ids.extend(added)
        if row in self.batch.generators:
            token = int(torch.randint(VOCAB, (1,), generator=self.batch.generators[row]))
        self.batch.append_token(row, token)
        state.output_token_ids.append(token)
        state.num_computed_tokens = state.num_tokens - 1
        self.batch.num_computed_tokens[row] = state.num_computed_tokens

    @invariant()
    def rows_match_model(self):
        batch = self.batch
        assert set(batch.req_id_to_index) == self.in_batch
        assert batch.num_reqs == len(self.in_batch)
        assert sum(r is not None for r in batch.req_ids) == batch.num_reqs
        assert set(batch.generators) <= set(batch.req_id_to_index.values())
        for req_id, row in batch.req_id_to_index.items():
            state, params = self.states[req_id], self.states[req_id].sampling_params
            assert batch.req_ids[row] == req_id
            n = state.num_tokens
            assert batch.num_tokens[row] == n
            assert batch.num_prompt_tokens[row] == len(state.prompt_token_ids)
            assert batch.num_computed_tokens[row] == state.num_computed_tokens
            assert (
                batch.token_ids[row, :n].tolist() == state.prompt_token_ids + state.output_token_ids
            )
            for table, ids in zip(batch.block_table.groups, state.block_ids, strict=True):
                assert table.np[row, : table.num_blocks_per_row[row]].tolist() == ids
            assert batch.temperature[row] == np.float32(params.temperature)
            assert batch.top_p[row] == np.float32(params.top_p)
            assert batch.top_k[row] == (params.top_k if 0 < params.top_k < VOCAB else 0)
            assert batch.min_p[row] == np.float32(params.min_p)
            assert batch.num_logprobs[row] == (-1 if params.logprobs is None else params.logprobs)
            if params.seed is None:
                assert row not in batch.generators
            else:
                assert batch.generators[row] is state.generator
            assert (row in batch.penalties) == params.uses_penalties
            assert batch.logit_bias.get(row, {}) == params.logit_bias
            assert batch.allowed_token_ids.get(row) == params.allowed_token_ids

    @invariant()
    def sampling_metadata_matches_model(self):
        rows = [r for r, req_id in enumerate(self.batch.req_ids) if req_id is not None]
        params = [self.states[self.batch.req_ids[r]].sampling_params for r in rows]
        metadata = self.batch.make_sampling_metadata()
        if not self.batch.penalties:  # penalties count each step's tokens afresh
            assert self.batch.make_sampling_metadata() is metadata
        assert metadata.temperature.tolist() == [np.float32(p.temperature) for p in params]
        random = [p for p in params if p.temperature > 0]
        assert metadata.all_greedy == (not random)
        assert metadata.all_random == (len(random) == len(params))
        assert (metadata.top_k is None) == all(p.top_k in (-1, 0, VOCAB) for p in random)
        assert (metadata.top_p is None) == all(p.top_p == 1.0 for p in random)
        assert (metadata.min_p is None) == all(p.min_p == 0.0 for p in random)
        if metadata.top_k is not None:
            assert metadata.top_k.tolist() == [
                p.top_k if 0 < p.top_k < VOCAB else 0 for p in params
            ]
        expected_generators = {
            i: self.states[self.batch.req_ids[r]].generator
            for i, r in enumerate(rows)
            if params[i].seed is not None
        }
        assert metadata.generators.keys() == expected_generators.keys()
        assert all(metadata.generators[i] is g for i, g in expected_generators.items())
        counts = [p.logprobs for p in params if p.logprobs is not None]
        assert metadata.max_num_logprobs == (max(counts) if counts else None)


TestInputBatchMachine = InputBatchMachine.TestCase
TestInputBatchMachine.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


def test_generator_stream_continues_across_re_adds():
    params = SamplingParams(temperature=1.0, seed=1234)
    state = new_request("a", [1, 2, 3], params)
    reference = torch.Generator().manual_seed(1234)
    batch = make_batch()
    batch.add_request(new_request("b", [4], SamplingParams()))
    for _ in range(3):
        row = batch.add_request(state)
        draw = torch.rand(4, generator=batch.make_sampling_metadata().generators[row])
        assert torch.equal(draw, torch.rand(4, generator=reference))
        batch.remove_request("a")
        batch.condense()


def test_row_order_selects_and_orders_rows():
    batch = make_batch()
    for i, t in enumerate([0.0, 0.5, 1.0]):
        batch.add_request(new_request(f"r{i}", [1], SamplingParams(temperature=t, seed=i or None)))
    metadata = batch.make_sampling_metadata(np.array([2, 1]))
    assert metadata.temperature.tolist() == [1.0, 0.5]
    assert metadata.all_random and not metadata.all_greedy
    assert metadata.generators == {0: batch.generators[2], 1: batch.generators[1]}
    assert batch.make_sampling_metadata(np.array([2, 1])) is metadata
    assert batch.make_sampling_metadata(np.array([0])).all_greedy


def test_vectorised_append_and_limits():
    batch = make_batch()
    for i in range(MAX_REQS):
        batch.add_request(new_request(f"r{i}", [i] * (i + 1), SamplingParams()))
    with pytest.raises(ValueError, match="full"):
        batch.add_request(new_request("extra", [1], SamplingParams()))
    with pytest.raises(ValueError, match="already"):
        batch.remove_request("r0")
        batch.add_request(new_request("r1", [1], SamplingParams()))
    batch.append_token(np.array([1, 3, 4]), np.array([41, 43, 44]))
    assert batch.num_tokens[1:5].tolist() == [3, 3, 5, 6]
    assert batch.token_ids[3, :5].tolist() == [3, 3, 3, 3, 43]
    assert batch.token_ids[1, :3].tolist() == [1, 1, 41]
    with pytest.raises(ValueError, match="max_model_len"):
        batch.add_request(new_request("long", [1] * (MAX_MODEL_LEN + 1), SamplingParams()))
