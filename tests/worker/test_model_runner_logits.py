"""Logits processing through the model runner: each request's settings act on its own
row only, with the token table the runner keeps up to date."""

from ipc.sampling_params import SamplingParams
from tests.worker.logits_helpers import GREEDY, NUM_STEPS, generate


def test_each_request_gets_its_own_logits_processing(runner):
    alone = generate(runner, {"plain": GREEDY})["plain"]
    mixed = generate(
        runner,
        {
            "allowed": SamplingParams(temperature=0.0, allowed_token_ids=[17, 40]),
            "plain": GREEDY,
            "biased": SamplingParams(temperature=0.0, logit_bias={23: 100.0}),
            "penalized": SamplingParams(temperature=0.0, repetition_penalty=1e9),
        },
    )
    assert mixed["plain"] == alone
    assert set(mixed["allowed"]) <= {17, 40}
    assert mixed["biased"] == [23] * NUM_STEPS
    # A huge repetition penalty pushes every seen token (the prompt's too) to about 0,
    # below the logits of unseen tokens that are positive: no token repeats.
    assert len(set(mixed["penalized"])) == NUM_STEPS and not set(mixed["penalized"]) & {5, 6, 7}
