"""ipc.tokenizer.Tokenizer gives what transformers' AutoTokenizer gives on the same folder."""

import json
import random
import shutil

import jinja2
import pytest
from client_fakes import tiny_tokenizer_path
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "héllo wörld 日本語 🙂",
    "line1\nline2\n\n\ttab",
    "<|im_start|>user\nhi<|im_end|>",
    "I'm sure you don't 123 4567 3.14",
    "a" * 300,
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Bonjour 🙂"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
]


def _default_model() -> str:
    from models.default import default_model_path

    try:
        return default_model_path()
    except RuntimeError as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def pair(request):
    path = tiny_tokenizer_path() if request.param == "tiny" else _default_model()
    return Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair, add_special_tokens):
    ours, hf = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == hf.encode(
            text, add_special_tokens=add_special_tokens
        ), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(pair, skip_special_tokens):
    ours, hf = pair
    rng = random.Random(0)
    vocab_size = ours.backend.get_vocab_size()
    sequences = [hf.encode(text) for text in TEXTS]
    sequences += [
        [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(50)
    ]
    sequences += [[hf.eos_token_id, *seq, hf.eos_token_id] for seq in sequences[:5]]
    for ids in sequences:
        assert ours.decode(ids, skip_special_tokens) == hf.decode(
            ids, skip_special_tokens=skip_special_tokens
        ), ids


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_any_text_encodes_and_decodes_as_transformers_does(pair, text):
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, add_generation_prompt):
    ours, hf = pair
    for conversation in CONVERSATIONS:
        expected = hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(conversation, add_generation_prompt) == expected
        assert ours.apply_chat_template(
            conversation, add_generation_prompt, tokenize=True
        ) == hf.encode(expected, add_special_tokens=False)


def test_special_token_ids_match_transformers(pair):
    ours, hf = pair
    assert ours.eos_token_id == hf.eos_token_id is not None
    assert ours.bos_token_id == hf.bos_token_id


# A template that reads every variable transformers passes, with block tags on their own
# (indented) lines, which transformers' trim_blocks and lstrip_blocks remove.
RICH_TEMPLATE = """{{ bos_token }}
{%- for m in messages %}
    {% if m['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('bad role: ' + m['role']) }}
    {% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
{{ m['role'] | upper }}: {{ m['content'] | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""


def _folder_with_config(tmp_path, name, chat_template=None, jinja_file=None):
    folder = tmp_path / name
    folder.mkdir()
    source = tiny_tokenizer_path()
    shutil.copy(f"{source}/tokenizer.json", folder)
    with open(f"{source}/tokenizer_config.json") as f:
        config = json.load(f)
    config["bos_token"] = {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (folder / "chat_template.jinja").write_text(jinja_file)
    return str(folder)


@pytest.mark.parametrize(
    ("chat_template", "jinja_file"),
    [
        (RICH_TEMPLATE, None),
        (
            [{"name": "default", "template": RICH_TEMPLATE}, {"name": "tool_use", "template": "x"}],
            None,
        ),
        ("{{ 'the config template loses to the file' }}", RICH_TEMPLATE),
    ],
    ids=["config", "named-list", "jinja-file-wins"],
)
def test_templates_from_the_config_render_as_transformers_does(tmp_path, chat_template, jinja_file):
    path = _folder_with_config(tmp_path, "t", chat_template, jinja_file)
    ours, hf = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    conversation = [
        {"role": "user", "content": 'say "hi" 🙂'},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
        {"role": "user", "content": "dropped by the break"},
    ]
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(conversation, add_generation_prompt) == expected
    bad = [{"role": "robot", "content": "beep"}]
    with pytest.raises(jinja2.TemplateError, match="bad role: robot"):
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(jinja2.TemplateError, match="bad role: robot"):
        ours.apply_chat_template(bad)


def test_a_tokenizer_without_chat_template_says_so(tmp_path):
    ours = Tokenizer.from_pretrained(_folder_with_config(tmp_path, "plain"))
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_folder_without_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
