"""How to sample one request (SamplingParams) and what its output must match
(StructuredOutputsParams): wire structs, validated at construction and when decoded."""

from __future__ import annotations

import json as _json

import msgspec

from ipc.kv_transfer import KVTransferParams

# The most choices (`n`) or candidates (`best_of`) one request may ask for.
MAX_N = 128


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


class StructuredOutputsParams(_Wire):
    """What the output must match: exactly one of a JSON schema (as JSON text; a dict is
    serialized), a regex, a choice of strings, a grammar (Lark or GBNF/EBNF), or any JSON
    object (vLLM's names). Compiled by llguidance in the EngineCore (ipc/grammar.py)."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # JSON without whitespace between its tokens (vLLM's option; JSON kinds only).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json)
        given = [name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(_STRUCTURED_KINDS)
            raise ValueError(
                f"structured_outputs needs exactly one of {names}; got {len(given)}"
                + (f" ({', '.join(given)})" if given else "")
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs choice must not be empty")

    @property
    def kind(self) -> str:
        """The name of the field that is set: json, regex, choice, grammar or json_object."""
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False))


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class SamplingParams(_Wire):
    """How to sample one request. Validated at construction and when decoded."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    allowed_token_ids: list[int] | None = None
    # Keep the stop string (or stop token) that ended the request in its text.
    include_stop_str_in_output: bool = False
    # Words never to generate. The side that has the tokenizer (ipc/bad_words.py) turns
    # them into bad_words_token_ids, which is what the workers use.
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] = []
    # Logprobs of each prompt token (but the first) given the tokens before it, and the
    # top-k at its position.
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Sample this many and return the n with the highest cumulative logprob (None: n).
    # New fields go last: the wire is array-like, so earlier positions stay put.
    best_of: int | None = None
    # Prefill/decode disaggregation (ipc/kv_transfer.py).
    kv_transfer_params: KVTransferParams | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.best_of is not None and not self.n <= self.best_of <= MAX_N:
            raise ValueError(f"best_of must be in [n, {MAX_N}] (n is {self.n}), got {self.best_of}")
        if self.kv_transfer_params is not None and (self.n > 1 or (self.best_of or 1) > 1):
            raise ValueError("kv_transfer_params takes one sequence: n and best_of must be 1")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        self._check_logits_processing()

    def _check_logits_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0 or self.repetition_penalty == float("inf"):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(t < 0 for t in self.logit_bias):
            raise ValueError("logit_bias token ids must be >= 0")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            if any(t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be >= 0")
        if any(not word for word in self.bad_words):
            raise ValueError("bad_words must not be empty strings")
        if any(not ids or min(ids) < 0 for ids in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty lists of ids >= 0")

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
