"""--seed seeds the sampling of requests that set no seed: two engines with the same seed
sample the same tokens, with different seeds different ones."""

from splitserve import LLM, SamplingParams

PROMPTS = [[1, 2, 3], [40, 41, 42, 43], [7] * 9]


def _sample(checkpoint: str, seed: int) -> list[list[int]]:
    llm = LLM(checkpoint, dtype="float32", max_model_len=64, num_gpu_blocks_override=16, seed=seed)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_same_seed_same_tokens_other_seed_other_tokens(checkpoint):
    first = _sample(checkpoint, seed=1)
    assert _sample(checkpoint, seed=1) == first
    assert _sample(checkpoint, seed=2) != first
