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

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for conv, out in zip(conversations, outs, strict=True):
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
            )[0, ids.shape[1] :].tolist()
        assert out.prompt_token_ids == ids[0].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    assert "Paris" in outs[0].outputs[0].text
