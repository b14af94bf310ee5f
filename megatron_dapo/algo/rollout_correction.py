"""Rollout correction: importance weights and rejection between the engine's policy and the trainer's.

The engine samples with its own kernels and precision (bf16, another TP layout, another
attention), so the behaviour policy pi_rollout is not exactly the trainer's pi_old. PPO's
ratio pi_theta / pi_old then corrects for the wrong distribution, and on long runs the
bias compounds (verl #3597, NeMo-RL #4243, TRL #4772). Two remedies, separable:

- importance sampling (IS): each token's loss is weighted by w = pi_old / pi_rollout,
  truncated at `is_threshold` (TIS: token level; or one weight per sequence, the product
  of its token ratios or their geometric mean), detached;
- rejection sampling (RS): tokens, or whole sequences, whose ratio (token, product or
  geometric mean) lies outside [rs_lower, rs_upper] leave the loss mask, so they are also
  left out of the token-mean's denominator.

Ratios are taken in log space and bounded to exp(+-20) before any product, so a sequence
of thousands of tokens cannot overflow. Everything here is per rank and pure; the caller
turns the local sums of `CorrectionStats` into global means.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["IS_LEVELS", "RS_LEVELS", "CorrectionStats", "rollout_correction"]

IS_LEVELS = ("token", "sequence", "geometric")
RS_LEVELS = ("token", "sequence", "geometric")
_MAX_LOG = 20.0


@dataclass(kw_only=True, slots=True)
class CorrectionStats:
    """Local sums of one rank's batch; divide by the global counts for the logged means."""

    num_tokens: float
    """Response tokens before rejection."""
    num_seqs: float
    """Sequences with at least one response token."""
    kl_k1: float
    """Sum over tokens of log pi_rollout - log pi_old (k1 estimate of KL(rollout || old))."""
    kl_k3: float
    """Sum over tokens of r - 1 - log r with r = pi_old / pi_rollout (k3, non-negative)."""
    weight_sum: float
    """Sum over kept tokens of the IS weight (after truncation)."""
    weight_max: float
    """Largest IS weight before truncation (0 without IS)."""
    num_truncated: float
    """Tokens whose IS weight was cut to the threshold."""
    num_rejected_tokens: float
    """Tokens that RS removed from the loss."""
    num_rejected_seqs: float
    """Sequences of which RS removed every response token."""

    def as_tensor(self) -> torch.Tensor:
        """[9] float64 in field order (weight_max is reduced with MAX, the rest with SUM)."""
        return torch.tensor([getattr(self, f) for f in self.__slots__], dtype=torch.float64)

    @classmethod
    def metrics(cls, sums: torch.Tensor, weight_max: float) -> dict[str, float]:
        """Logged means from globally summed `as_tensor` rows (and the global maximum weight)."""
        s = dict(zip(cls.__slots__, sums.tolist(), strict=True))
        tokens, seqs = max(s["num_tokens"], 1.0), max(s["num_seqs"], 1.0)
        kept = max(s["num_tokens"] - s["num_rejected_tokens"], 1.0)
        return {
            "rollout_corr/kl_k1": s["kl_k1"] / tokens,
            "rollout_corr/kl_k3": s["kl_k3"] / tokens,
            "rollout_corr/is_weight_mean": s["weight_sum"] / kept,
            "rollout_corr/is_weight_max": weight_max,
            "rollout_corr/truncated_token_frac": s["num_truncated"] / tokens,
            "rollout_corr/rejected_token_frac": s["num_rejected_tokens"] / tokens,
            "rollout_corr/rejected_seq_frac": s["num_rejected_seqs"] / seqs,
        }


def _level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[B, T] log-ratio at `level`: per token, or one per sequence (sum or mean) broadcast."""
    if level == "token":
        return log_ratio
    total = (log_ratio * mask).sum(-1, keepdim=True)
    if level == "geometric":
        total = total / mask.sum(-1, keepdim=True).clamp(min=1)
    return total.clamp(-_MAX_LOG, _MAX_LOG).expand_as(log_ratio)


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    is_level: str | None = None,
    is_threshold: float = 2.0,
    rs_level: str | None = None,
    rs_upper: float = 2.0,
    rs_lower: float = 0.5,
) -> tuple[torch.Tensor | None, torch.Tensor, CorrectionStats]:
    """IS weights, the RS-filtered loss mask and the mismatch statistics of one batch.

    Args:
        old_log_prob: [B, T] log pi_old of the sampled tokens (the trainer's recomputation).
        rollout_log_prob: [B, T] log pi_rollout (what the engine reported when sampling).
        response_mask: [B, T] bool, the tokens in the loss.
        is_level: "token" | "sequence" | "geometric" | None (no weights).
        is_threshold: the weights are truncated at this value (> 0).
        rs_level: "token" | "sequence" | "geometric" | None (no rejection).
        rs_upper: ratios above this are rejected.
        rs_lower: ratios below this are rejected.

    Returns:
        (weights [B, T] fp32 detached or None, mask [B, T] bool, stats). Weights are 0 off
        the returned mask; the mask is response_mask minus the rejected tokens.
    """
    if is_level is not None and is_level not in IS_LEVELS:
        raise ValueError(f"is_level={is_level!r} is not one of {IS_LEVELS} or None")
    if rs_level is not None and rs_level not in RS_LEVELS:
        raise ValueError(f"rs_level={rs_level!r} is not one of {RS_LEVELS} or None")
    if not (is_threshold > 0 and 0 <= rs_lower < rs_upper):
        raise ValueError(f"need is_threshold > 0 and 0 <= rs_lower < rs_upper, got {is_threshold}, "
                         f"{rs_lower}, {rs_upper}")
    mask = response_mask.bool()
    fmask = mask.to(torch.float64)
    log_ratio = torch.where(mask, (old_log_prob.double() - rollout_log_prob.double()), 0.0)
    log_ratio = log_ratio.clamp(-_MAX_LOG, _MAX_LOG)
    ratio = torch.exp(log_ratio)
    kl_k1 = float((-log_ratio * fmask).sum())
    kl_k3 = float(((ratio - 1 - log_ratio) * fmask).sum())

    keep = mask
    if rs_level is not None:
        level_ratio = torch.exp(_level_log_ratio(log_ratio, fmask, rs_level))
        keep = mask & (level_ratio <= rs_upper) & (level_ratio >= rs_lower)

    weights = None
    weight_max = num_truncated = 0.0
    weight_sum = float(keep.sum())
    if is_level is not None:
        raw = torch.exp(_level_log_ratio(log_ratio, fmask, is_level))
        weight_max = float(raw[mask].max()) if bool(mask.any()) else 0.0
        num_truncated = float(((raw > is_threshold) & keep).sum())
        w = torch.where(keep, raw.clamp(max=is_threshold), 0.0)
        weight_sum = float(w.sum())
        weights = w.to(torch.float32)
    has_tokens = mask.any(-1)
    stats = CorrectionStats(
        num_tokens=float(mask.sum()), num_seqs=float(has_tokens.sum()), kl_k1=kl_k1, kl_k3=kl_k3,
        weight_sum=weight_sum, weight_max=weight_max, num_truncated=num_truncated,
        num_rejected_tokens=float((mask & ~keep).sum()),
        num_rejected_seqs=float((has_tokens & ~keep.any(-1)).sum()),
    )
    return weights, keep, stats
