"""The policy-gradient loss of one micro-batch, for any `loss_mode` (step 6).

`compute_policy_loss` checks its inputs, takes the log-ratio once, hands the rows to the
mode's function (algo/loss_modes.py: vanilla is DAPO's Clip-Higher PPO surrogate with the
optional dual clip, per token, with r = pi_theta / pi_old and A the response's advantage:

    loss = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))        (Clip-Higher)
    loss = min(loss, -A * c)                  for A < 0, when c is set  (dual clip)

) and reduces the per-token losses with `agg_loss`, which makes the loss and the metrics
sums over micro-batches when the global counts are given. Token metrics are means over
the mini-batch's valid tokens, sequence metrics (GSPO's) means over its non-empty sequences.
"""

from __future__ import annotations

import torch

from megatron_dapo.algo.aggregation import agg_loss
from megatron_dapo.algo.loss_inputs import LossInputs, ModeParams
from megatron_dapo.algo.loss_modes import POLICY_LOSS_MODES

# exp(20) ~ 5e8: far past any clip bound, and finite in fp16/bf16/fp32.
_MAX_LOG_RATIO = 20.0


def _check_clip_ratios(loss_mode: str, clips: bool, clip_ratio_low: float | None, clip_ratio_high: float | None,
                       clip_ratio_c: float | None) -> None:
    if clip_ratio_low is None or clip_ratio_high is None:
        if clips:
            raise ValueError(f"loss_mode={loss_mode!r} clips the ratio: pass clip_ratio_low and clip_ratio_high "
                             "(algorithm.clip_ratio_low / clip_ratio_high)")
    else:
        if not 0 <= clip_ratio_low <= 1:
            raise ValueError(
                f"clip_ratio_low={clip_ratio_low} (algorithm.clip_ratio_low) must be in [0, 1] so that "
                "1 - clip_ratio_low is not negative; DAPO uses 0.2"
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
    clip_ratio_low: float | None,
    clip_ratio_high: float | None,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    num_global_tokens: int | torch.Tensor | None = None,
    num_global_seqs: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
    *,
    loss_mode: str = "vanilla",
    params: ModeParams | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of one micro-batch in `loss_mode`, aggregated with `agg_loss`.

    Args:
        log_prob: [B, T] log-probs of the sampled tokens under the current policy (grad flows).
        old_log_prob: [B, T] log-probs under the policy that generated the batch (no grad).
        advantages: [B] per response, or [B, T] per token.
        response_mask: [B, T] bool or 0/1, the tokens that carry loss (tool tokens are 0).
        clip_ratio_low: eps_low, the ratio is clipped below at 1 - eps_low (DAPO: 0.2; GMPO
            clips the log-ratio at -eps_low); None for the modes without a ratio clip.
        clip_ratio_high: eps_high, the ratio is clipped above at 1 + eps_high (DAPO: 0.28).
        clip_ratio_c: dual-clip bound c > 1 for A < 0 (vanilla, clip_cov); None = no dual clip.
        loss_agg_mode: one of `LOSS_AGG_MODES` (DAPO: "token-mean"); which ones a mode allows is
            checked at config time (config/policy_loss.py).
        num_global_tokens: valid tokens of the whole mini-batch, see `agg_loss`; also the
            denominator of the token metrics.
        num_global_seqs: valid sequences of the whole mini-batch (seq-* modes, sequence metrics).
        loss_scale_factor: constant divisor of "seq-mean-token-sum-norm" (required there).
        is_weights: [B, T] rollout-correction weights (algo/rollout_correction.py) multiplying
            each token's clipped loss, no grad; None = 1.
        loss_mode: a key of `POLICY_LOSS_MODES` (verl's names).
        params: the modes' own parameters (clip_cov_*, kl_cov_ratio, ppo_kl_coef, tau_*);
            None = the papers' defaults.
        generator: clip_cov's random choice (None: seeded from the micro-batch).

    Returns:
        (loss, metrics): loss is a 0-dim tensor with grad. metrics are detached 0-dim tensors
        (fp32, fp64 for fp64 inputs), local sums over the global counts, so they too add up
        over micro-batches and ranks, named by the mode's `metrics` (vanilla: pg_clipfrac,
        tokens where the clipped branch is strictly larger, so active; pg_clipfrac_lower,
        tokens where the dual clip is active; ppo_kl, old_log_prob - log_prob clamped to +-20).
    """
    mode = POLICY_LOSS_MODES.get(loss_mode)
    if mode is None:
        raise ValueError(f"unknown loss_mode {loss_mode!r} (algorithm.policy_loss.loss_mode); "
                         f"use one of {', '.join(POLICY_LOSS_MODES)}")
    _check_clip_ratios(loss_mode, mode.clips, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    if log_prob.shape != old_log_prob.shape or log_prob.shape != response_mask.shape:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must share one [B, T] shape"
        )
    if advantages.dim() == 1 and advantages.shape[0] == log_prob.shape[0]:
        advantages = advantages.unsqueeze(-1)  # [B] -> [B, 1], one advantage per response
    elif advantages.shape != log_prob.shape and advantages.shape != (log_prob.shape[0], 1):
        raise ValueError(
            f"advantages of shape {tuple(advantages.shape)} fit neither [B]={log_prob.shape[0]} "
            f"nor [B, T]={tuple(log_prob.shape)}"
        )
    advantages = advantages.to(log_prob.dtype).expand_as(log_prob)

    valid = response_mask.bool()
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-_MAX_LOG_RATIO, max=_MAX_LOG_RATIO)
    # Padding may hold NaN log-probs; zeroing them here keeps NaN out of the backward pass
    # too (agg_loss alone would only keep it out of the forward value).
    inputs = LossInputs(
        log_prob=torch.where(valid, log_prob, zero), log_ratio=torch.where(valid, log_ratio, zero),
        advantages=advantages, valid=valid, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c, params=params if params is not None else ModeParams(), is_weights=is_weights,
        generator=generator,
    )
    result = mode.fn(inputs)
    loss = agg_loss(
        result.pg_losses,
        response_mask,
        loss_agg_mode,
        num_global_tokens=num_global_tokens,
        num_global_seqs=num_global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    # At least fp32: a bf16 sum of 0/1 flags over many tokens would round the fractions.
    metric_dtype = torch.promote_types(log_prob.dtype, torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, values in result.token_metrics.items():
            metrics[name] = agg_loss(values.to(metric_dtype), response_mask, "token-mean", num_global_tokens)
        if result.seq_metrics:
            has_token = valid.any(dim=-1)
            seqs = has_token.sum() if num_global_seqs is None else num_global_seqs
            seqs = seqs.clamp(min=1) if isinstance(seqs, torch.Tensor) else max(seqs, 1)
            for name, values in result.seq_metrics.items():
                metrics[name] = torch.where(has_token, values.to(metric_dtype), 0.0).sum() / seqs
    return loss, {name: metrics[name] for name in mode.metrics}
