"""What the logits-processing tests share: a hand-made InputBatch of requests, and greedy
steps of requests through a ModelRunner."""

from ipc.messages import NewRequestData
from ipc.sampling_params import SamplingParams
from tests.worker.scheduler_outputs import decoding, runner_step
from worker.input_batch import CachedRequestState, InputBatch

VOCAB, MAX_REQS, MAX_MODEL_LEN = 12, 6, 32


def make_batch(requests) -> InputBatch:
    batch = InputBatch(MAX_REQS, MAX_MODEL_LEN, 1, 16, "cpu", VOCAB)
    for i, (params, prompt, output) in enumerate(requests):
        new = NewRequestData(f"r{i}", prompt, params, [[]], 0, output_token_ids=output)
        batch.add_request(CachedRequestState.from_new_request(new, "cpu"))
    return batch


PROMPT = [5, 6, 7]
NUM_STEPS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS)


def generate(runner, requests: dict[str, SamplingParams]) -> dict[str, list[int]]:
    """Prefill then greedy decode steps; each request owns one block of 8 tokens."""
    new = [NewRequestData(r, PROMPT, p, [[i + 1]], 0) for i, (r, p) in enumerate(requests.items())]
    out = runner.execute_model(runner_step(0, new))
    tokens = {r: list(t) for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True)}
    for step in range(1, NUM_STEPS):
        cached = decoding(dict.fromkeys(requests, len(PROMPT) + step - 1))
        out = runner.execute_model(
            runner_step(step, cached=cached, scheduled=dict.fromkeys(requests, 1))
        )
        for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True):
            tokens[r] += t
    runner.execute_model(runner_step(NUM_STEPS, finished=list(requests)))
    return tokens
