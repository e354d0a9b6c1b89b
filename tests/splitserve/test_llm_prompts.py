"""The prompt forms vLLM's LLM.generate takes, on a tiny random Llama: a text, token ids,
a TextPrompt or a TokensPrompt dict, alone or in a list; each answers as its token ids
do, and RequestOutput.prompt holds the text when there was one."""

import pytest

from splitserve import LLM, SamplingParams, TextPrompt, TokensPrompt

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, dtype="float32", kv_cache_memory=8 << 20, max_model_len=128)


def test_every_prompt_form_answers_as_its_token_ids(llm):
    text = "hello there"
    ids = llm.get_tokenizer().encode(text)
    want = llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    forms = [text, ids, TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids)]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == [want] * 4
    assert [out.prompt_token_ids for out in outs] == [ids] * 4
    assert [out.prompt for out in outs] == [text, None, text, None]
    for single in (text, ids, {"prompt": text}, {"prompt_token_ids": ids}):
        (out,) = llm.generate(single, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == want


def test_a_prompt_dict_with_anything_else_is_refused(llm):
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "hi", "multi_modal_data": {}}, GREEDY, use_tqdm=False)
