"""Rejection sampling of drafts drawn from a draft distribution q (speculative decoding's
accept rule, Leviathan et al. / Chen et al.).

At each position j of a row, with p_j the target's distribution there (every sampling
setting applied) and q_j the one the draft x_j was drawn from: accept x_j with probability
min(1, p_j(x_j) / q_j(x_j)); at the first rejection the row's next token comes from the
residual max(p_j - q_j, 0), renormalised, and the row ends there; when every draft is
accepted, one more token comes from p after the last draft. Each produced token is then
distributed exactly as p at its position.

A draft that is a point mass (q_j = one-hot: prompt lookup, a greedy draft) needs no q:
worker/step_output.py's DraftVerification covers it, seeded streams included. This path
serves unseeded random rows whose drafts the draft model sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftProbs:
    """The rows of a step that verify sampled drafts: `first_logits_rows[i]` is row i's
    first logits row (its d_i drafts' positions and the one after follow it), `draft_ids`
    [R, k] and `probs` [R, k, V] (q) padded past d_i."""

    first_logits_rows: torch.Tensor  # [R] long
    num_drafts: torch.Tensor  # [R] long
    draft_ids: torch.Tensor  # [R, k] long
    probs: torch.Tensor  # [R, k, V] float32

    def logits_rows(self) -> torch.Tensor:
        """[R, k + 1]: row i's logits rows at its positions, past d_i its last one."""
        k = self.draft_ids.shape[1]
        positions = torch.arange(k + 1, device=self.draft_ids.device)
        last = (self.first_logits_rows + self.num_drafts).unsqueeze(1)
        return (self.first_logits_rows.unsqueeze(1) + positions).minimum(last)


def rejection_sample(
    target_probs: torch.Tensor,
    drafts: DraftProbs,
    u_accept: torch.Tensor,
    u_resample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_probs` [R, k + 1, V]: p at each row's positions (padded past d_i). Returns
    (num_accepted [R], the token after the accepted drafts [R]), with one uniform per
    draft (`u_accept` [R, k]) and one per row for the last token (`u_resample` [R])."""
    num_rows, k = drafts.draft_ids.shape
    ids = drafts.draft_ids.unsqueeze(2)
    p_draft = target_probs[:, :k].gather(2, ids).squeeze(2)
    q_draft = drafts.probs.gather(2, ids).squeeze(2)
    positions = torch.arange(k, device=ids.device)
    accepted = (u_accept * q_draft <= p_draft) & (positions < drafts.num_drafts.unsqueeze(1))
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(num_rows, device=ids.device)
    p_last = target_probs[rows, num_accepted]
    q_last = drafts.probs[rows, num_accepted.clamp(max=k - 1)]
    rejected = num_accepted < drafts.num_drafts
    residual = torch.where(rejected.unsqueeze(1), (p_last - q_last).clamp(min=0.0), p_last)
    # p <= q everywhere only where p == q, and then nothing is rejected; rounding aside.
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, p_last, residual)
    cdf = residual.cumsum(dim=1)
    token = torch.searchsorted(cdf, u_resample.unsqueeze(1) * cdf[:, -1:], right=True)
    return num_accepted, token.squeeze(1).clamp(max=residual.shape[1] - 1)


def write_rejection_samples(
    sampled: torch.Tensor,
    drafts: DraftProbs,
    num_accepted: torch.Tensor,
    token: torch.Tensor,
) -> None:
    """Express the outcome in `sampled` (one token per logits row), in place, as the
    point-mass rule reads it: the accepted drafts at their positions, then the token (never
    the draft it replaces: a rejected draft has no residual mass)."""
    k = drafts.draft_ids.shape[1]
    positions = torch.arange(k + 1, device=sampled.device)
    index = drafts.logits_rows()
    padded = torch.cat([drafts.draft_ids, drafts.draft_ids[:, :1]], dim=1)
    values = torch.where(positions == num_accepted.unsqueeze(1), token.unsqueeze(1), padded)
    keep = positions <= num_accepted.unsqueeze(1)
    sampled.index_put_((index[keep],), values[keep])
