"""Why a request can never run, checked once when it arrives: lengths against
max_model_len, and every token id a worker indexes a vocabulary-sized tensor with; and at
start, whether the KV cache holds a request of max_model_len at all."""

from __future__ import annotations

from collections.abc import Sequence

from engine_core.request import Request
from ipc.config import EngineConfig
from ipc.sampling_params import SamplingParams
from ipc.utils import cdiv

_INT64 = 2**63


def check_lengths(request: Request, max_model_len: int) -> str | None:
    """Why the prompt, or the prompt and its max_tokens (at least one output token), do
    not fit in max_model_len, or None."""
    num_prompt = request.num_prompt_tokens
    if num_prompt == 0:
        return "the prompt is empty"
    if num_prompt >= max_model_len:
        return (
            f"the prompt has {num_prompt} tokens; max_model_len is {max_model_len} "
            "and at least one token must be left for the output"
        )
    num_output = request.max_tokens or max(1, request.min_tokens)
    if num_prompt + num_output > max_model_len:
        return (
            f"the prompt ({num_prompt} tokens) plus max_tokens ({num_output}) exceeds "
            f"max_model_len ({max_model_len})"
        )
    return None


def check_token_ids(
    prompt_token_ids: list[int], params: SamplingParams, config: EngineConfig
) -> str | None:
    """Why a request's token ids (prompt, stop ids, logit_bias, allowed ids, bad words) or
    seed cannot run, or None. Every id the workers index a vocabulary-sized tensor with is
    checked here, at the edge."""
    vocab_size = config.vocab_size or _INT64
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        return f"prompt token ids must be in [0, {vocab_size})"
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        return f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}"
    bad = [t for t in params.logit_bias if not 0 <= t < vocab_size]
    if bad:
        return f"logit_bias token ids must be in [0, {vocab_size}), got {bad[0]}"
    bad = [t for t in params.allowed_token_ids or () if not 0 <= t < vocab_size]
    if bad:
        return f"allowed_token_ids must be in [0, {vocab_size}), got {bad[0]}"
    bad = [t for ids in params.bad_words_token_ids for t in ids if not 0 <= t < vocab_size]
    if bad:
        return f"bad_words_token_ids must be in [0, {vocab_size}), got {bad[0]}"
    if params.seed is not None and not -_INT64 <= params.seed < 2 * _INT64:
        return f"seed must be a 64-bit integer, got {params.seed}"
    return None


def check_kv_cache_size(
    config: EngineConfig, group_windows: Sequence[int | None], num_blocks: int
) -> None:
    """Raise ValueError when `num_blocks` (the null block among them) cannot hold one
    request of max_model_len."""
    blocks_per_request = _max_blocks_per_request(config, group_windows)
    usable_blocks = num_blocks - 1
    if usable_blocks < blocks_per_request:
        raise ValueError(
            f"the KV cache holds {usable_blocks} blocks of {config.block_size} tokens, fewer "
            f"than one request of max_model_len={config.max_model_len} needs "
            f"({blocks_per_request}); lower max_model_len or give the KV cache more memory"
        )


def _max_blocks_per_request(config: EngineConfig, group_windows: Sequence[int | None]) -> int:
    """Blocks one request of max_model_len tokens may hold at once, over every KV cache
    group: all of its blocks in a full-attention group; in a window-W group the blocks a
    step's tokens and the W - 1 before them span."""
    full = cdiv(config.max_model_len, config.block_size)
    return sum(
        full
        if window is None
        else min(full, cdiv(window - 1 + config.max_num_batched_tokens, config.block_size) + 1)
        for window in group_windows
    )
