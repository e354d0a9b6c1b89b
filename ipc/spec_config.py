"""SpeculativeConfig: vLLM's `--speculative-config` JSON, validated once.

`ngram` proposes by prompt lookup over a request's own tokens, in the EngineCore (drafts
travel in the SchedulerOutput). `draft_model` runs a smaller model of the same tokenizer
(`model`, a folder or a .gguf file) in the workers beside the target: each step it drafts
the next tokens of every request that sampled, and they come back in the
ModelRunnerOutput (worker/draft_model.py). The other methods vLLM knows are refused as
not available yet rather than run without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ipc.json_config import from_json_value, json_object, json_option_parser

SPEC_METHODS = ("ngram", "draft_model")
_PLANNED_METHODS = ("eagle", "eagle3", "medusa", "mtp")
# More draft tokens than this never pay on any device we measured, and bound the worker's
# per-step logits rows (max_num_seqs x (1 + k)).
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """`disable_by_batch_size`: no drafts in a step while more requests than this are
    running (vLLM's name); None: no bound. `adaptive`: steps speculate only while measured
    steps with drafts generate more tokens per second than steps without
    (engine_core/spec_gate.py); off, every step below the bound speculates."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None  # draft_model's checkpoint
    # ngram's; None: 2 and 4 for ngram (draft_model takes none).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method in _PLANNED_METHODS:
            raise ValueError(
                f"speculative_config: method {self.method!r} is not available yet; "
                f"supported: {', '.join(SPEC_METHODS)}"
            )
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config: unknown method {self.method!r}; "
                f"supported: {', '.join(SPEC_METHODS)}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config: method draft_model needs a model (its path), and "
                "only draft_model takes one"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config: model must be a path, got {self.model!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be <= "
                f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if self.method == "ngram":
            self.prompt_lookup_min = 2 if self.prompt_lookup_min is None else self.prompt_lookup_min
            _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
            if self.prompt_lookup_max is None:
                self.prompt_lookup_max = max(4, self.prompt_lookup_min)
            _check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError(
                "speculative_config: prompt_lookup_min and prompt_lookup_max only apply to "
                "method ngram"
            )
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1)
        if not isinstance(self.adaptive, bool):
            raise ValueError(
                f"speculative_config: adaptive must be true or false, got {self.adaptive!r}"
            )

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a config, a dict or its JSON text; unknown keys are refused by name."""
        if not isinstance(value, SpeculativeConfig):
            value = json_object(value, "speculative_config")
            if value.get("method") in _PLANNED_METHODS:
                return cls(method=value["method"])  # refused with its reason
        return from_json_value(cls, value, "speculative_config")


parse_speculative_config = json_option_parser(SpeculativeConfig.from_value)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"speculative_config: {name} must be an integer >= {minimum}, got {value!r}"
        )
