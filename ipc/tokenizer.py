"""A Hugging Face tokenizer folder without transformers (which would pull in torch), and
`TokenizerLike`, what the clients, the detokenizer and the server take (this `Tokenizer`,
or a test's stand-in).

tokenizer.json runs through the `tokenizers` library, exactly as transformers' fast
tokenizers do; special tokens come from tokenizer_config.json; the chat template from
chat_template.jinja (which wins, as in transformers) or tokenizer_config.json, rendered
with jinja2 in a sandbox with the variables transformers gives it.

`encode_chat` keeps message content text: special-token text a user writes ("<|im_end|>")
is encoded as plain text, so only the template's own special tokens are special.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.meta
import tokenizers

from ipc.chat_template import (
    Message,
    default_template,
    environment,
    hide,
    holds,
    open_final_message,
    placeholder_nonce,
    reveal,
    with_end,
)

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Longer texts are encoded with encode_batch, which releases the GIL while it works
# (encode holds it), so other threads (an event loop) keep running.
_LONG_TEXT_CHARS = 16_384
# The most a normalizer can shrink a text (bytes in / bytes out): NFKC maps the 4-byte
# "𝐀" to "A", NFC composes three 3-byte Hangul jamo into one 3-byte syllable.
_NORMALIZER_SHRINK = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1}
# Pre-tokenizers that keep every byte of the text (others drop whitespace or delimiters).
_KEEPING_PRE_TOKENIZERS = {
    "ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"
}  # fmt: skip


class TokenizerLike(Protocol):
    """What the clients, the detokenizer and the server need of a tokenizer."""

    def min_num_tokens(self, text: str) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> str: ...

    def encode_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]: ...

    @property
    def chat_template_takes_tools(self) -> bool: ...


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, chat_template: str | None = None
    ) -> Tokenizer:
        """The folder's tokenizer; `chat_template`, when given, replaces the folder's."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        special_tokens = {
            name: _token_text(config[name])
            for name in _SPECIAL_TOKEN_NAMES
            if config.get(name) is not None
        }
        template_file = folder / "chat_template.jinja"
        if chat_template is not None:
            template = chat_template
        elif template_file.is_file():
            template = template_file.read_text()
        else:
            template = default_template(config.get("chat_template"))
        return cls(backend, special_tokens, template)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return _encode(self.backend, text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        tokenize: bool = False,
    ) -> str | list[int]:
        """The conversation as the model's prompt text (token ids with tokenize=True,
        without added special tokens: the template writes them). `tools` (OpenAI's tool
        definitions) reach the template as transformers passes them. With
        `continue_final_message` the text ends with the final message's content, left
        open for the model to continue (transformers' option of that name)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError(
                    "continue_final_message and add_generation_prompt cannot both be set"
                )
            end = placeholder_nonce(messages)
            messages = [*messages[:-1], with_end(messages[-1], end)]
        text = self._compiled_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **({} if tools is None else {"tools": tools}),
            **self.special_tokens,
        )
        if continue_final_message:
            text = open_final_message(text, end)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @functools.cached_property
    def _compiled_template(self) -> jinja2.Template:
        return environment().from_string(self.chat_template)

    @functools.cached_property
    def chat_template_takes_tools(self) -> bool:
        """Whether the chat template reads `tools` (has a tools section)."""
        if self.chat_template is None:
            return False
        parsed = environment().parse(self.chat_template)
        return "tools" in jinja2.meta.find_undeclared_variables(parsed)

    def encode_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The conversation's prompt token ids, with special-token text inside the messages
        encoded as plain text. Without such text, exactly
        `encode(apply_chat_template(messages, ...), add_special_tokens=False)`."""
        specials = self._special_texts
        options = (add_generation_prompt, tools, continue_final_message)
        if not holds([messages, tools], specials):
            return self.apply_chat_template(messages, *options, tokenize=True)
        # Hide the messages' special-token text behind placeholders while the template
        # renders, so every special token left in the text is the template's own.
        nonce = placeholder_nonce([messages, tools])
        hidden = [hide(m, specials, nonce) for m in messages]
        hidden_tools = hide(tools, specials, nonce)
        text = self.apply_chat_template(
            hidden, add_generation_prompt, hidden_tools, continue_final_message
        )
        ids: list[int] = []
        for i, piece in enumerate(self._special_pattern.split(text)):
            if i % 2:
                token = piece if piece in specials else piece.strip()  # stripped whitespace
                ids.append(self.backend.token_to_id(token))
            elif piece:
                plain = reveal(piece, specials, nonce)
                ids += _encode(self._plain_backend, plain, add_special_tokens=False)
        return ids

    @functools.cached_property
    def _special_texts(self) -> list[str]:
        """The special added tokens' texts, longest first (the tokenizer matches the
        longest at each position)."""
        added = self.backend.get_added_tokens_decoder().values()
        return sorted((t.content for t in added if t.special), key=len, reverse=True)

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern:
        """Splits a text at special tokens as the tokenizer does, whitespace that a
        token strips included."""
        added = {t.content: t for t in self.backend.get_added_tokens_decoder().values()}
        alternatives = [
            (r"\s*" if added[text].lstrip else "")
            + re.escape(text)
            + (r"\s*" if added[text].rstrip else "")
            for text in self._special_texts
        ]
        return re.compile(f"({'|'.join(alternatives)})" if alternatives else "(?!)")

    @functools.cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        """The tokenizer with special-token text encoded as text (transformers'
        split_special_tokens)."""
        plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of input text one token can stand for, so that a text of
        n bytes encodes to at least n / max_token_bytes tokens. None where there is no
        such bound: a normalizer or pre-tokenizer that drops text, an unknown token that
        absorbs a run of text, a special token that strips whitespace."""
        spec = json.loads(self.backend.to_str())
        shrink = _normalizer_shrink(spec.get("normalizer"))
        if shrink is None or not _keeps_every_byte(spec.get("pre_tokenizer")):
            return None
        model = spec["model"]
        if model["type"] == "BPE":
            unknown_char = model.get("unk_token") is not None and not model.get("byte_fallback")
            if unknown_char and model.get("fuse_unk"):
                return None
        elif model["type"] == "Unigram" and model.get("byte_fallback"):
            unknown_char = False
        else:
            return None  # a run of unknown text (or a whole word) becomes one token
        vocab = model["vocab"]
        texts = list(vocab) if isinstance(vocab, dict) else [text for text, _ in vocab]
        if _is_byte_level(spec.get("pre_tokenizer")):
            if unknown_char:
                return None
            most = max(map(len, texts))  # one character per byte
        else:
            most = max(len(text.encode()) for text in texts)
        for token in spec.get("added_tokens", ()):
            if token["lstrip"] or token["rstrip"]:
                return None
            most = max(most, len(token["content"].encode()))
        return shrink * max(most, 4 if unknown_char else 1)

    @functools.cached_property
    def _dropped_bytes(self) -> bytes:
        """The bytes a byte-level vocabulary has no token for: encoding drops them."""
        spec = json.loads(self.backend.to_str())
        if not _is_byte_level(spec.get("pre_tokenizer")):
            return b""
        vocab = spec["model"]["vocab"]
        texts = set(vocab) if isinstance(vocab, dict) else {text for text, _ in vocab}
        return bytes(b for b, char in enumerate(_byte_chars()) if char not in texts)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on the length of `encode(text)`, found without tokenizing: a
        token stands for at most max_token_bytes bytes of the text it keeps (0: no bound
        is known)."""
        most = self.max_token_bytes
        if most is None:
            return 0
        kept = text.encode("utf-8", "surrogatepass").translate(None, self._dropped_bytes)
        return -(-len(kept) // most)


def _byte_chars() -> list[str]:
    """The character byte-level pre-tokenizers write for each byte 0..255: printable
    Latin-1 bytes stand for themselves, the others for characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + extra))
            extra += 1
    return chars


def _token_text(token: str | dict[str, Any]) -> str:
    """Special tokens are saved as plain strings or as AddedToken dicts."""
    return token["content"] if isinstance(token, dict) else token


def _encode(backend: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > _LONG_TEXT_CHARS:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    if normalizer["type"] == "Sequence":
        factor = 1
        for part in normalizer["normalizers"]:
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    return _NORMALIZER_SHRINK.get(normalizer["type"])


def _keeps_every_byte(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer["type"] == "Sequence":
        return all(map(_keeps_every_byte, pre_tokenizer["pretokenizers"]))
    return (
        pre_tokenizer["type"] in _KEEPING_PRE_TOKENIZERS
        and pre_tokenizer.get("behavior") != "Removed"
    )


def _is_byte_level(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer["type"] == "Sequence":
        return any(map(_is_byte_level, pre_tokenizer["pretokenizers"]))
    return pre_tokenizer["type"] == "ByteLevel"
