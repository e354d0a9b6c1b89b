"""Allowed token ids, logit bias and penalties over a whole batch, against a loop over the
vocabulary, one row at a time, written from vLLM's documented semantics."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc.sampling_params import SamplingParams
from tests.worker.logits_helpers import MAX_REQS, VOCAB, make_batch
from worker.sampler import Sampler, process_logits

token = st.integers(0, VOCAB - 1)
penalty = st.sampled_from([0.0, 0.0, -2.0, -0.5, 0.7, 2.0])
sampling_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1.0]),
    presence_penalty=penalty,
    frequency_penalty=penalty,
    repetition_penalty=st.sampled_from([1.0, 1.0, 0.5, 1.3, 2.0]),
    logit_bias=st.one_of(st.just({}), st.dictionaries(token, st.floats(-100, 100), max_size=4)),
    allowed_token_ids=st.one_of(st.none(), st.lists(token, min_size=1, max_size=5)),
)
request = st.tuples(
    sampling_params,
    st.lists(token, min_size=1, max_size=10),  # prompt
    st.lists(token, max_size=10),  # outputs so far
)


def reference(logits: np.ndarray, params: SamplingParams, prompt, output) -> np.ndarray:
    row = logits.astype(np.float64)
    for t in range(VOCAB):
        if params.allowed_token_ids is not None and t not in params.allowed_token_ids:
            row[t] = -np.inf
        row[t] += params.logit_bias.get(t, 0.0)
        if t in prompt or t in output:
            if row[t] > 0:
                row[t] /= params.repetition_penalty
            else:
                row[t] *= params.repetition_penalty
        count = output.count(t)
        row[t] -= params.frequency_penalty * count
        if count > 0:
            row[t] -= params.presence_penalty
    return row


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(request, min_size=1, max_size=MAX_REQS),
    removed=st.sets(st.integers(0, MAX_REQS - 1), max_size=2),
    appended=st.lists(token, max_size=MAX_REQS),
    seed=st.integers(0, 2**16),
)
def test_processed_logits_match_the_reference(requests, removed, appended, seed):
    batch = make_batch(requests)
    # Holes and moved rows, then one more output token for some rows.
    live = [i for i in range(len(requests)) if i not in removed] or list(range(len(requests)))
    for i in set(range(len(requests))) - set(live):
        batch.remove_request(f"r{i}")
    batch.condense()
    outputs = {i: list(requests[i][2]) for i in live}
    for i, token_id in zip(live, appended, strict=False):
        batch.append_token(batch.req_id_to_index[f"r{i}"], token_id)
        outputs[i].append(token_id)
    # Logits rows in reverse batch order: metadata follows the row order it is given.
    row_order = np.arange(batch.num_reqs)[::-1].copy()
    logits = 3 * torch.randn(len(row_order), VOCAB, generator=torch.Generator().manual_seed(seed))
    processed = process_logits(logits.clone(), batch.make_sampling_metadata(row_order))
    for logits_row, batch_row in enumerate(row_order.tolist()):
        i = int(batch.req_ids[batch_row][1:])
        params, prompt, _ = requests[i]
        expected = reference(logits[logits_row].numpy(), params, prompt, outputs[i])
        np.testing.assert_allclose(processed[logits_row].numpy(), expected, rtol=1e-5, atol=1e-4)


def test_a_batch_without_logits_processing_builds_and_copies_nothing():
    plain = (SamplingParams(temperature=0.5), [1, 2, 3], [4])
    batch = make_batch([plain, plain])
    metadata = batch.make_sampling_metadata()
    assert metadata.allowed_tokens is None and metadata.logit_bias is None
    assert metadata.penalties is None and not metadata.blocked_token_ids
    logits = torch.randn(2, VOCAB)
    assert process_logits(logits, metadata) is logits


def test_only_the_rows_that_use_a_transform_carry_it():
    plain = (SamplingParams(), [1, 2], [])
    penalized = (SamplingParams(frequency_penalty=1.0), [1, 2], [3, 3])
    biased = (SamplingParams(logit_bias={5: 1.0}), [1], [])
    metadata = make_batch([plain, penalized, plain, biased]).make_sampling_metadata()
    assert metadata.penalties.rows.tolist() == [1]
    assert metadata.logit_bias.rows.tolist() == [3]
    assert metadata.allowed_tokens is None


def test_greedy_sampling_sees_processed_logits_and_logprobs_the_raw_ones():
    params = SamplingParams(temperature=0.0, logprobs=0, allowed_token_ids=[7, 9])
    batch = make_batch([(params, [1, 2], []), (SamplingParams(temperature=0.0), [1], [])])
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 10.0
    logits[:, 9] = 1.0
    out = Sampler()(logits, batch.make_sampling_metadata())
    assert out.sampled_token_ids.tolist() == [9, 3]
    raw = logits.log_softmax(dim=-1)
    assert torch.allclose(out.logprobs.logprobs[:, 0], raw[[0, 1], [9, 3]])
