"""transformers as the oracle of a quantized model: the same architecture with every
linear weight replaced by what the quantized weight dequantizes to."""

from collections.abc import Callable

import torch

from splitserve import LLM, SamplingParams
from tests.models.tiny import load_reference

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A greedy token of int8 activations at most this far (in standard deviations of the
# position's logits) below the reference's best: measured up to 0.13 on the default model,
# 0.07 on the tiny ones; a wrong layer moves tokens by whole deviations.
NEAR_TIE = 0.25


@torch.no_grad()
def dequantized_reference(path: str, dequantize: Callable[[str, torch.Tensor], torch.Tensor]):
    """The float32 transformers model of `path` with each linear layer's weight w (named
    `name`) replaced by dequantize(name, w)."""
    model = load_reference(path)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS:
            module.weight.copy_(dequantize(name, module.weight.data))
    return model


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def check_greedy(llm: LLM, reference, prompts: list[list[int]], max_tokens: int = 12) -> None:
    """The engine's greedy tokens of each prompt are the reference model's."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(reference, prompt, max_tokens)


@torch.no_grad()
def check_near_greedy(llm: LLM, reference, prompts: list[list[int]], max_tokens: int = 12) -> None:
    """Each of the engine's greedy tokens is the reference model's on the same prefix, or a
    near tie: its logit at most NEAR_TIE standard deviations of that position's logits below
    the best one, and at most a tenth of the tokens differ."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
    gaps = []
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        tokens = out.outputs[0].token_ids
        ids = torch.tensor([prompt + tokens])
        logits = reference(ids).logits[0, len(prompt) - 1 : -1].double()
        picked = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        gaps.append((logits.amax(dim=1) - picked) / logits.std(dim=1))
    gap = torch.cat(gaps)
    assert gap.max() <= NEAR_TIE and (gap > 0).float().mean() <= 0.1, gap
