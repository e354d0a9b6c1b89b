"""The grammar bitmask on the worker against a plain Python reading of the wire layout:
row k, word w, bit j allows token 32 * w + j of the logits row of request_ids[k]. On the
GPU when there is one."""

import numpy as np
import pytest
import torch

from worker.grammar_bitmask import apply_grammar_bitmask, unpack_bitmask


def reference_allowed(words: np.ndarray, vocab_size: int) -> np.ndarray:
    allowed = np.zeros((words.shape[0], vocab_size), dtype=bool)
    for k in range(words.shape[0]):
        for token in range(vocab_size):
            w, j = divmod(token, 32)
            allowed[k, token] = w < words.shape[1] and (int(words[k, w]) >> j) & 1 == 1
    return allowed


def random_words(rng: np.random.Generator, num_rows: int, vocab_size: int) -> np.ndarray:
    bits = rng.random((num_rows, 32 * -(-vocab_size // 32))) < 0.3
    return np.packbits(bits, axis=1, bitorder="little").view("<i4").copy()


@pytest.mark.parametrize("vocab_size", [288, 100, 31, 64])
def test_unpack_matches_the_reference(vocab_size, kernel_device):
    words = random_words(np.random.default_rng(vocab_size), 5, vocab_size)
    words[0, :] = -1  # every bit, the sign bit included
    words[1, :] = np.int32(-(2**31))  # the sign bit alone
    got = unpack_bitmask(torch.from_numpy(words).to(kernel_device), vocab_size).cpu().numpy()
    np.testing.assert_array_equal(got, reference_allowed(words, vocab_size))


def test_logits_past_the_bitmask_are_disallowed():
    words = np.full((1, 2), -1, dtype="<i4")  # 64 tokens allowed
    np.testing.assert_array_equal(unpack_bitmask(torch.from_numpy(words), 70)[0, 64:], False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_the_rows_of_sampling_structured_requests_are_masked(dtype, kernel_device):
    vocab_size = 100
    rng = np.random.default_rng(0)
    batch_req_ids = ["a", None, "b", "c", "d"]  # batch rows; None: a free row
    sample_rows = np.array([0, 2, 4])  # logits rows 0, 1, 2 are a, b, d; c does not sample
    request_ids = ["d", "c", "a"]  # structured; c's row is skipped, b is not structured
    words = random_words(rng, 3, vocab_size)
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = logits.clone()
    logits = logits.to(kernel_device)
    allowed = reference_allowed(words, vocab_size)
    for k, logits_row in ((0, 2), (2, 0)):
        expected[logits_row, torch.from_numpy(~allowed[k])] = float("-inf")
    apply_grammar_bitmask(logits, request_ids, words.tobytes(), batch_req_ids, sample_rows)
    assert logits.dtype == dtype and logits.device.type == kernel_device
    logits = logits.cpu()
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert torch.isinf(logits[0]).sum() == (~allowed[2]).sum()


def test_nothing_happens_when_no_structured_request_samples():
    logits = torch.randn(2, 64)
    before = logits.clone()
    words = np.zeros((1, 2), dtype="<i4")
    apply_grammar_bitmask(logits, ["x"], words.tobytes(), ["a", "b"], np.array([0, 1]))
    torch.testing.assert_close(logits, before, rtol=0, atol=0)


def test_a_request_verifying_drafts_has_a_mask_row_per_position():
    vocab_size = 64
    words = random_words(np.random.default_rng(3), 5, vocab_size)
    batch_req_ids = ["a", "b"]
    logits_rows = np.array([0, 0, 0, 1, 1])  # a verifies 2 drafts, b 1
    request_ids = ["b", "a"]  # bitmask rows: b's 2, then a's 3
    logits = torch.zeros(5, vocab_size)
    apply_grammar_bitmask(
        logits, request_ids, words.tobytes(), batch_req_ids, logits_rows, {"a": [1, 2], "b": [3]}
    )
    allowed = reference_allowed(words, vocab_size)
    expected_rows = [allowed[2], allowed[3], allowed[4], allowed[0], allowed[1]]
    np.testing.assert_array_equal((logits == 0).numpy(), np.stack(expected_rows))
