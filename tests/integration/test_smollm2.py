"""The default model, SmolLM2-135M-Instruct, end to end against transformers (slow)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.default import default_model_path
from splitserve import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
]
MAX_TOKENS = 40


@pytest.mark.slow
def test_chat_equals_transformers_greedy():
    path = default_model_path()
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    llm = LLM(path, dtype="float32", max_model_len=1024, kv_cache_memory=256 << 20)
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))

    # The model goes on with an answer it was given the start of.
    started = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": "It"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    conversations.append(started)
    outs += llm.chat(started, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), **options)

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for conv, out in zip(conversations, outs, strict=True):
        kwargs = options if conv is started else {"add_generation_prompt": True}
        text = tokenizer.apply_chat_template(conv, tokenize=False, **kwargs)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
            )[0, ids.shape[1] :].tolist()
        assert out.prompt_token_ids == ids[0].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    assert "Paris" in outs[0].outputs[0].text


@pytest.mark.slow
def test_bf16_engine_tracks_transformers_fp32():
    """The bf16 CPU kernels (the AMX prefill and decode paths where the CPU has AMX) end to
    end: prompt logprobs of a real text, read in chunks and with a cached prefix, stay
    within bf16 noise of transformers in fp32, and every greedy token is one fp32 would
    also rank at or near the top."""
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = " ".join(
        f"Chapter {i}: the river ran past the mill, and the miller counted {i * 7} sacks."
        for i in range(12)
    )
    prompt = tokenizer.encode(text)  # a few hundred tokens: many 16-row query tiles
    llm = LLM(
        path,
        dtype="bfloat16",
        max_model_len=1024,
        kv_cache_memory=256 << 20,
        max_num_batched_tokens=128,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0)
    first, again = llm.generate([prompt, prompt], params)  # the second hits the prefix cache
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for out in (first, again):
        generated = out.outputs[0].token_ids
        ids = torch.tensor([prompt + generated])
        with torch.no_grad():
            logprobs = model(ids).logits[0].log_softmax(-1)
        targets = ids[0, 1:]
        ref = logprobs[:-1].gather(1, targets[:, None])[:, 0]
        pairs = zip(prompt[1:], out.prompt_logprobs[1:], strict=True)
        ours = torch.tensor([entry[token].logprob for token, entry in pairs])
        gap = (ours - ref[: len(prompt) - 1]).abs()
        assert gap.mean() < 0.05 and gap.max() < 0.5, (gap.mean(), gap.max())
        start = len(prompt) - 1
        for i, token in enumerate(generated):
            row = logprobs[start + i]
            assert row[token] > row.max() - 0.3, f"greedy token {i} is far from fp32's choice"
