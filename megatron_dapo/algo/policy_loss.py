"""The DAPO policy-gradient loss: Clip-Higher PPO surrogate, optional dual clip (step 6).

Per token, with r = pi_theta / pi_old and A the response's advantage:

    loss = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))        (Clip-Higher)
    loss = min(loss, -A * c)                  for A < 0, when c is set  (dual clip)

A decoupled, larger eps_high lets low-probability tokens grow (the paper's remedy for
entropy collapse); the dual clip bounds the loss of a negative-advantage token whose
ratio has exploded. The branches are chosen with strict comparisons, so a token
counted in pg_clipfrac / pg_clipfrac_lower is exactly a token that gets no gradient,
and a ratio exactly on a clip boundary keeps the unclipped gradient.

The per-token losses are reduced with `agg_loss`, which makes the loss (and the
metrics) sums over micro-batches when the global counts are given.
"""

from __future__ import annotations

import torch

from megatron_dapo.algo.aggregation import agg_loss

# exp(20) ~ 5e8: far past any clip bound, and finite in fp16/bf16/fp32.
_MAX_LOG_RATIO = 20.0


def _check_clip_ratios(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None) -> None:
    if not 0 <= clip_ratio_low < 1:
        raise ValueError(
            f"clip_ratio_low={clip_ratio_low} (algorithm.clip_ratio_low) must be in [0, 1) so that "
            "1 - clip_ratio_low stays positive; DAPO uses 0.2"
        )
    if clip_ratio_high < 0:
        raise ValueError(
            f"clip_ratio_high={clip_ratio_high} (algorithm.clip_ratio_high) must be >= 0; DAPO uses 0.28"
        )
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ValueError(
            f"clip_ratio_c={clip_ratio_c} (algorithm.clip_ratio_c) must be > 1, or null to turn "
            "the dual clip off; verl uses 3.0"
        )


def compute_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    num_global_tokens: int | torch.Tensor | None = None,
    num_global_seqs: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Higher PPO loss of one micro-batch, aggregated with `agg_loss`.

    Args:
        log_prob: [B, T] log-probs of the sampled tokens under the current policy (grad flows).
        old_log_prob: [B, T] log-probs under the policy that generated the batch (no grad).
        advantages: [B] per response, or [B, T] per token.
        response_mask: [B, T] bool or 0/1, the tokens that carry loss.
        clip_ratio_low: eps_low, the ratio is clipped below at 1 - eps_low (DAPO: 0.2).
        clip_ratio_high: eps_high, the ratio is clipped above at 1 + eps_high (DAPO: 0.28).
        clip_ratio_c: dual-clip bound c > 1 for A < 0; None = no dual clip.
        loss_agg_mode: one of `LOSS_AGG_MODES` (DAPO: "token-mean").
        num_global_tokens: valid tokens of the whole mini-batch, see `agg_loss`; also the
            denominator of the metrics.
        num_global_seqs: valid sequences of the whole mini-batch (seq-* modes).
        loss_scale_factor: constant divisor of "seq-mean-token-sum-norm" (required there).
        is_weights: [B, T] rollout-correction weights (algo/rollout_correction.py) multiplying
            each token's clipped loss, no grad; None = 1.

    Returns:
        (loss, metrics): loss is a 0-dim tensor with grad. metrics are detached 0-dim tensors
        (fp32, fp64 for fp64 inputs), token means over the valid tokens (local sums over
        `num_global_tokens` when given, so they too add up over micro-batches and ranks):
        pg_clipfrac: tokens where the clipped branch is strictly larger, so active;
        pg_clipfrac_lower: tokens where the dual clip is active (0 without dual clip);
        ppo_kl: old_log_prob - log_prob, the log-ratio clamped to +-20 as for the ratio.
    """
    _check_clip_ratios(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    if log_prob.shape != old_log_prob.shape or log_prob.shape != response_mask.shape:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must share one [B, T] shape"
        )
    if advantages.dim() == 1 and advantages.shape[0] == log_prob.shape[0]:
        advantages = advantages.unsqueeze(-1)  # [B] -> [B, 1], one advantage per response
    elif advantages.shape != log_prob.shape:
        raise ValueError(
            f"advantages of shape {tuple(advantages.shape)} fit neither [B]={log_prob.shape[0]} "
            f"nor [B, T]={tuple(log_prob.shape)}"
        )
    advantages = advantages.to(log_prob.dtype)

    log_ratio = torch.clamp(log_prob - old_log_prob, min=-_MAX_LOG_RATIO, max=_MAX_LOG_RATIO)
    # Padding may hold NaN log-probs; zeroing them here keeps NaN out of the backward pass
    # too (agg_loss alone would only keep it out of the forward value).
    log_ratio = torch.where(response_mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, min=1.0 - clip_ratio_low, max=1.0 + clip_ratio_high)
    clip_active = clipped > unclipped
    pg_losses = torch.where(clip_active, clipped, unclipped)
    if clip_ratio_c is None:
        dual_active = torch.zeros_like(clip_active)
    else:
        dual_bound = (-advantages * clip_ratio_c).expand_as(pg_losses)
        dual_active = (advantages < 0) & (pg_losses > dual_bound)
        pg_losses = torch.where(dual_active, dual_bound, pg_losses)
    if is_weights is not None:
        pg_losses = pg_losses * is_weights.to(pg_losses.dtype)

    loss = agg_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        num_global_tokens=num_global_tokens,
        num_global_seqs=num_global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    # At least fp32: a bf16 sum of 0/1 flags over many tokens would round the fractions.
    metric_dtype = torch.promote_types(log_prob.dtype, torch.float32)
    with torch.no_grad():
        metrics = {
            name: agg_loss(values.to(metric_dtype), response_mask, "token-mean", num_global_tokens)
            for name, values in (
                ("pg_clipfrac", clip_active),
                ("pg_clipfrac_lower", dual_active),
                ("ppo_kl", -log_ratio),
            )
        }
    return loss, metrics
