"""Batched logits processing before sampling: allowed token ids, bad words, logit bias,
and presence / frequency / repetition penalties (vLLM's semantics). Each transform touches
only the logits rows that use it; a batch where no row does builds nothing here."""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AllowedTokens:
    """`allowed[i]` is True for the tokens logits row `rows[i]` may sample."""

    rows: torch.Tensor
    allowed: torch.Tensor


@dataclass
class BadWords:
    """One entry per (logits row, token id it may not sample now)."""

    rows: torch.Tensor
    token_ids: torch.Tensor


@dataclass
class LogitBias:
    """One entry per (logits row, token id, bias)."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    bias: torch.Tensor


@dataclass
class Penalties:
    """Token ids are padded with vocab_size (one past the vocabulary), counted then cut."""

    rows: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    prompt_token_ids: torch.Tensor
    output_token_ids: torch.Tensor


def make_allowed_tokens(
    allowed: dict[int, list[int]], vocab_size: int, device: torch.device
) -> AllowedTokens | None:
    """`allowed`: logits row -> token ids it may sample."""
    if not allowed:
        return None
    rows = list(allowed)
    mask = np.zeros((len(rows), vocab_size), dtype=np.bool_)
    for i, token_ids in enumerate(allowed.values()):
        mask[i, token_ids] = True
    return AllowedTokens(_long(rows, device), torch.from_numpy(mask).to(device))


def bad_words_table(words: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """A row's bad words as (prefixes, last tokens): each word's tokens but its last,
    right-aligned in a row padded with -1, and its last token."""
    width = max(len(word) for word in words) - 1
    prefixes = np.full((len(words), width), -1, dtype=np.int64)
    for i, word in enumerate(words):
        prefixes[i, width - len(word) + 1 :] = word[:-1]
    return prefixes, np.array([word[-1] for word in words], dtype=np.int64)


def make_bad_words(
    rows: np.ndarray,
    tables: dict[int, tuple[np.ndarray, np.ndarray]],
    token_ids: np.ndarray,
    num_prompt_tokens: np.ndarray,
    ends: np.ndarray,
    device: torch.device,
) -> BadWords | None:
    """A word's last token is banned when the output so far ends with the word's other
    tokens (always, for a one-token word). `tables`: batch row -> bad_words_table of the
    rows that have bad words; the other arguments as in make_penalties."""
    logits_rows, banned = [], []
    for i, row in enumerate(rows.tolist()):
        table = tables.get(row)
        if table is None:
            continue
        prefixes, last = table
        width = prefixes.shape[1]
        end = int(ends[i])
        start = max(int(num_prompt_tokens[row]), end - width)
        tail = np.full(width, -2, dtype=np.int64)  # -2: no output token here
        tail[width - (end - start) :] = token_ids[row, start:end]
        ended = ((prefixes == tail) | (prefixes == -1)).all(axis=1)
        ids = np.unique(last[ended]).tolist()
        logits_rows += [i] * len(ids)
        banned += ids
    if not logits_rows:
        return None
    return BadWords(_long(logits_rows, device), _long(banned, device))


def make_logit_bias(bias: dict[int, dict[int, float]], device: torch.device) -> LogitBias | None:
    """`bias`: logits row -> {token id: bias}."""
    if not bias:
        return None
    rows = [row for row, per_token in bias.items() for _ in per_token]
    token_ids = [t for per_token in bias.values() for t in per_token]
    values = [b for per_token in bias.values() for b in per_token.values()]
    return LogitBias(
        _long(rows, device),
        _long(token_ids, device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def make_penalties(
    rows: np.ndarray,
    settings: dict[int, tuple[float, float, float]],
    token_ids: np.ndarray,
    num_prompt_tokens: np.ndarray,
    ends: np.ndarray,
    vocab_size: int,
    device: torch.device,
) -> Penalties | None:
    """`rows[i]`: the batch row of logits row i; `settings`: batch row -> (presence,
    frequency, repetition) penalties of the rows that use them; `token_ids[rows[i],
    :ends[i]]`: logits row i's tokens so far, its prompt's first (a row that verifies
    drafts has one logits row per position, each seeing the drafts before it)."""
    logits_rows, per_row, prompts, outputs = [], [], [], []
    for i, row in enumerate(rows.tolist()):
        if row in settings:
            num_prompt = num_prompt_tokens[row]
            logits_rows.append(i)
            per_row.append(settings[row])
            prompts.append(token_ids[row, :num_prompt])
            outputs.append(token_ids[row, num_prompt : ends[i]])
    if not logits_rows:
        return None
    presence, frequency, repetition = torch.tensor(per_row, dtype=torch.float32).T.to(device)
    return Penalties(
        _long(logits_rows, device),
        presence,
        frequency,
        repetition,
        _padded(prompts, vocab_size, device),
        _padded(outputs, vocab_size, device),
    )


def apply_allowed_tokens(logits: torch.Tensor, allowed: AllowedTokens) -> torch.Tensor:
    logits[allowed.rows] = logits[allowed.rows].masked_fill(~allowed.allowed, float("-inf"))
    return logits


def apply_bad_words(logits: torch.Tensor, bad_words: BadWords) -> torch.Tensor:
    inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put_((bad_words.rows, bad_words.token_ids), inf)


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    return logits.index_put_((bias.rows, bias.token_ids), bias.bias, accumulate=True)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition over prompt and output tokens (positive logits divided by the penalty,
    negative ones multiplied), then frequency x count and presence once for each output
    token so far."""
    vocab_size = logits.shape[1]
    rows = logits[penalties.rows]
    output_counts = _counts(penalties.output_token_ids, vocab_size)
    in_output = output_counts > 0
    in_prompt = _counts(penalties.prompt_token_ids, vocab_size) > 0
    repetition = penalties.repetition.unsqueeze(1)
    penalized = torch.where(rows > 0, rows / repetition, rows * repetition)
    rows = torch.where(in_prompt | in_output, penalized, rows)
    rows -= penalties.frequency.unsqueeze(1) * output_counts
    rows -= penalties.presence.unsqueeze(1) * in_output
    logits[penalties.rows] = rows
    return logits


def _counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device
    )
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _padded(token_ids: list[np.ndarray], pad: int, device: torch.device) -> torch.Tensor:
    out = np.full((len(token_ids), max(len(t) for t in token_ids)), pad, dtype=np.int64)
    for i, ids in enumerate(token_ids):
        out[i, : len(ids)] = ids
    return torch.from_numpy(out).to(device)


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
