"""Logits processing through the model runner: each request's settings act on its own
row only, with the token table the runner keeps up to date."""

from ipc.messages import CachedRequestData, NewRequestData, SchedulerOutput
from ipc.sampling_params import SamplingParams

PROMPT = [5, 6, 7]
NUM_STEPS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS)


def generate(runner, requests: dict[str, SamplingParams]) -> dict[str, list[int]]:
    """Prefill then greedy decode steps; each request owns one block of 8 tokens."""
    new = [NewRequestData(r, PROMPT, p, [[i + 1]], 0) for i, (r, p) in enumerate(requests.items())]
    scheduled = {r: len(PROMPT) for r in requests}
    out = runner.execute_model(
        SchedulerOutput(0, new, CachedRequestData(), scheduled, sum(scheduled.values()))
    )
    tokens = {r: list(t) for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True)}
    for step in range(1, NUM_STEPS):
        ids = list(requests)
        cached = CachedRequestData(
            ids,
            [False] * len(ids),
            [[]] * len(ids),
            [[[]]] * len(ids),
            [len(PROMPT) + step - 1] * len(ids),
        )
        out = runner.execute_model(
            SchedulerOutput(step, [], cached, dict.fromkeys(ids, 1), len(ids))
        )
        for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True):
            tokens[r] += t
    runner.execute_model(SchedulerOutput(NUM_STEPS, [], CachedRequestData(), {}, 0, list(requests)))
    return tokens


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
