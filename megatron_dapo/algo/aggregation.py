"""Reduce a per-token loss matrix to the scalar that is back-propagated (step 6).

DAPO's token-level loss divides the sum of per-token losses by the number of valid
tokens of the WHOLE mini-batch, however that mini-batch is cut into micro-batches,
data-parallel ranks and pipeline stages. A micro-batch cannot know that number, so
`agg_loss` takes it as an argument: the actor counts once per mini-batch with
`count_tokens_and_seqs`, sums the counts over micro-batches and all-reduces them over
data-parallel ranks, then hands the totals to every micro-batch. Each micro-batch then
returns its LOCAL sum over the GLOBAL count, so summing the returned losses (which is
what gradient accumulation and the DP gradient all-reduce do) gives exactly the
whole-batch loss and gradient. Without the counts, the micro-batch is treated as the
whole batch.

The GRPO-style modes kept for ablations (verl's names):
- "seq-mean-token-mean": mean over sequences of each sequence's token mean (GRPO).
- "seq-mean-token-sum": mean over sequences of each sequence's token sum.
- "seq-mean-token-sum-norm": the same divided by a constant `loss_scale_factor`
  (Dr.GRPO's MAX_TOKENS; the config's default is data.max_response_length). It must be
  a constant: a length taken from the batch (its padded width, its longest sequence)
  changes with every mini-batch and micro-batch, so the loss of a sequence would depend
  on which others it is batched with. verl's older version sums over sequences without
  the mean; dividing by the sequence count here keeps the loss independent of how many
  ranks and micro-batches share the batch.
Sequences without a valid token count for nothing in any mode and produce no NaN.

Entropy bonuses and KL terms are aggregated with the same function, so they obey the
same invariance.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""Accepted values of `loss_agg_mode` (config key algorithm.loss_agg_mode)."""


def count_tokens_and_seqs(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Count what `agg_loss` divides by, in the form the caller can all-reduce.

    Sum the results over the micro-batches of a mini-batch and all-reduce (SUM) them over
    data-parallel ranks to get `num_global_tokens` / `num_global_seqs`. They stay tensors on
    the mask's device so that no host synchronisation is forced.

    Args:
        response_mask: [B, T] bool or 0/1, the tokens that carry loss.

    Returns:
        (num_tokens, num_seqs): int64 scalars; num_seqs counts only sequences with at least
        one valid token, matching how `agg_loss` counts when no global count is given.
    """
    valid = response_mask.bool()
    num_tokens = valid.sum()
    num_seqs = valid.any(dim=-1).sum()
    return num_tokens, num_seqs


def _denominator(count: int | float | torch.Tensor) -> int | float | torch.Tensor:
    # An empty batch has a zero numerator too; dividing by 1 returns 0 instead of NaN.
    if isinstance(count, torch.Tensor):
        return count.clamp(min=1)
    return max(count, 1)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    num_global_tokens: int | torch.Tensor | None = None,
    num_global_seqs: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar, normalised by global counts when given.

    Positions where `mask` is 0 are ignored even if `loss_mat` holds inf/NaN there.

    Args:
        loss_mat: [B, T] per-token values (loss, entropy, KL, a 0/1 indicator, ...).
        mask: [B, T] bool or 0/1, which tokens count.
        mode: one of `LOSS_AGG_MODES`.
        num_global_tokens: valid tokens of the whole mini-batch ("token-mean"); None = this
            batch's own count.
        num_global_seqs: sequences with a valid token in the whole mini-batch (the seq-*
            modes); None = this batch's own count.
        loss_scale_factor: constant divisor of "seq-mean-token-sum-norm" (required there),
            e.g. data.max_response_length; ignored by the other modes.

    Returns:
        A 0-dim tensor of `loss_mat`'s dtype: sum over valid tokens of the mode's per-token
        weight times `loss_mat`.
    """
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"agg_loss needs loss_mat and mask of the same [B, T] shape, got {tuple(loss_mat.shape)} "
            f"and {tuple(mask.shape)}; pass per-token values of the response tokens"
        )
    valid = mask.bool()
    # where(), not a product: padding may hold inf/NaN log-probs, and NaN * 0 is NaN.
    masked = torch.where(valid, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if mode == "token-mean":
        count = valid.sum() if num_global_tokens is None else num_global_tokens
        return masked.sum() / _denominator(count)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r} (algorithm.loss_agg_mode); "
            f"use one of {', '.join(LOSS_AGG_MODES)}"
        )

    seq_sums = masked.sum(dim=-1)  # [B]
    if mode == "seq-mean-token-mean":
        seq_tokens = valid.sum(dim=-1)  # [B]
        seq_values = seq_sums / seq_tokens.clamp(min=1).to(loss_mat.dtype)
    else:
        seq_values = seq_sums
    count = valid.any(dim=-1).sum() if num_global_seqs is None else num_global_seqs
    loss = seq_values.sum() / _denominator(count)
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or loss_scale_factor <= 0:
            raise ValueError(
                f"loss_scale_factor must be > 0 for seq-mean-token-sum-norm, got {loss_scale_factor}; "
                "pass a constant such as the maximum response length (algorithm.loss_scale_factor)"
            )
        loss = loss / loss_scale_factor
    return loss
