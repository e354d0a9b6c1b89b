"""Bad words over a whole batch against a plain reference of vLLM's rule: a one-token
word's token is always banned; a longer word's last token when the output so far ends
with the word's other tokens. Then the tokenization of words, and the transform through
the model runner."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc.bad_words import bad_words_token_ids, with_bad_words_token_ids
from ipc.messages import NewRequestData
from ipc.sampling_params import SamplingParams
from ipc.tokenizer import Tokenizer
from tests.ipc.client_fakes import tiny_tokenizer_path
from tests.worker.logits_helpers import GREEDY, VOCAB, generate, make_batch
from worker.input_batch import check_new_request
from worker.sampler import process_logits

token = st.integers(0, 4)  # a small alphabet, so prefixes often match
word = st.lists(token, min_size=1, max_size=3)
request = st.tuples(
    st.lists(word, max_size=4),
    st.lists(token, min_size=1, max_size=6),  # prompt
    st.lists(token, max_size=6),  # outputs so far
)


def banned(words: list[list[int]], output: list[int]) -> set[int]:
    out = set()
    for w in words:
        prefix = w[:-1]
        if len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix:
            out.add(w[-1])
    return out


@settings(max_examples=150, deadline=None)
@given(requests=st.lists(request, min_size=1, max_size=6), removed=st.integers(0, 5))
def test_banned_tokens_match_the_reference(requests, removed):
    batch = make_batch([(SamplingParams(bad_words_token_ids=w), p, o) for w, p, o in requests])
    if removed < len(requests) > 1:  # a hole, then moved rows
        batch.remove_request(f"r{removed}")
        batch.condense()
    row_order = np.arange(batch.num_reqs)[::-1].copy()
    logits = torch.randn(len(row_order), VOCAB)
    processed = process_logits(logits.clone(), batch.make_sampling_metadata(row_order))
    for logits_row, batch_row in enumerate(row_order.tolist()):
        words, _, output = requests[int(batch.req_ids[batch_row][1:])]
        expected = banned(words, output)
        assert set(np.flatnonzero(processed[logits_row] == -np.inf)) == expected
        kept = [t for t in range(VOCAB) if t not in expected]
        assert torch.equal(processed[logits_row, kept], logits[logits_row, kept])


def test_a_batch_without_bad_words_builds_none():
    batch = make_batch([(SamplingParams(min_tokens=1), [1, 2], [])])
    assert batch.make_sampling_metadata().bad_words is None


def test_the_banned_set_follows_the_output():
    params = SamplingParams(bad_words_token_ids=[[3, 4], [7]])
    batch = make_batch([(params, [3], [])])
    rows = batch.make_sampling_metadata().bad_words
    assert rows.token_ids.tolist() == [7]  # the prompt's 3 does not count
    batch.append_token(0, 3)
    assert sorted(batch.make_sampling_metadata().bad_words.token_ids.tolist()) == [4, 7]


def test_words_are_tokenized_as_is_and_mid_text():
    tokenizer = Tokenizer.from_pretrained(tiny_tokenizer_path())
    ids = bad_words_token_ids([" hello", "x"], tokenizer)
    forms = [tokenizer.encode(t, add_special_tokens=False) for t in ("hello", " hello", "x", " x")]
    assert ids == [f for i, f in enumerate(forms) if f not in forms[:i]]
    params = with_bad_words_token_ids(SamplingParams(bad_words=["x"]), tokenizer)
    assert params.bad_words_token_ids == [forms[2], forms[3]]
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        with_bad_words_token_ids(SamplingParams(bad_words=["x"]), None)


def test_bad_words_through_the_model_runner(runner):
    plain = generate(runner, {"plain": GREEDY})["plain"]
    first, second = plain[0], plain[1]
    out = generate(
        runner,
        {
            "word": SamplingParams(temperature=0.0, bad_words_token_ids=[[first]]),
            "pair": SamplingParams(temperature=0.0, bad_words_token_ids=[[first, second]]),
            "plain": GREEDY,
        },
    )
    assert out["plain"] == plain
    assert first not in out["word"]
    assert out["pair"][0] == first and out["pair"][1] != second


def test_out_of_vocabulary_bad_words_fail_the_request_alone(runner):
    vocab_size = runner.input_batch.vocab_size
    bad = SamplingParams(bad_words_token_ids=[[1, vocab_size]])
    error = check_new_request(NewRequestData("bad", [5, 6], bad, [[1]], 0), vocab_size)
    assert "bad_words_token_ids" in error
