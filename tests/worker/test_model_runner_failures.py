"""A request the worker cannot take fails alone: it is reported in the step's output, left
out of the forward pass, and the rest of the batch samples exactly as it would without it.
(A stop token id past the vocabulary once raised IndexError in the sampler's min_tokens
mask and took the whole cluster down.)"""

import pytest

from ipc.messages import NewRequestData
from ipc.sampling_params import SamplingParams
from tests.worker.scheduler_outputs import runner_step

VOCAB_SIZE = 288  # the tiny checkpoint's
GOOD = SamplingParams(temperature=0.0, max_tokens=4)


def _new(req_id: str, block: int, params: SamplingParams, prompt=(5, 6, 7)) -> NewRequestData:
    return NewRequestData(req_id, list(prompt), params, [[block]], 0)


@pytest.mark.parametrize(
    ("params", "prompt", "error"),
    [
        (SamplingParams(min_tokens=2, stop_token_ids=[VOCAB_SIZE]), (5, 6, 7), "stop_token_ids"),
        (GOOD, (5, VOCAB_SIZE + 3, 7), "token ids must be in"),
        (SamplingParams(logit_bias={3: 1.0, VOCAB_SIZE: 5.0}), (5, 6, 7), "logit_bias"),
        (SamplingParams(allowed_token_ids=[VOCAB_SIZE + 1]), (5, 6, 7), "allowed_token_ids"),
    ],
)
def test_a_bad_request_fails_alone(runner, params, prompt, error):
    alone = runner.execute_model(runner_step(0, [_new("good", 1, GOOD)]))
    runner.execute_model(runner_step(1, finished=["good"]))
    step = runner_step(2, [_new("bad", 2, params, prompt), _new("good2", 3, GOOD)])
    out = runner.execute_model(step)
    assert list(out.failed_requests) == ["bad"] and error in out.failed_requests["bad"]
    assert out.req_ids == ["good2"]
    assert out.sampled_token_ids == alone.sampled_token_ids
    # The engine finishes the failed request; the next step does not trip over it.
    finish = runner_step(3, finished=["bad", "good2"])
    assert runner.execute_model(finish).failed_requests == {}
    assert runner.input_batch.num_reqs == 0 and not runner.requests
