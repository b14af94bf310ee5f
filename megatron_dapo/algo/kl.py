"""Per-token KL estimators between the actor and a reference policy (off in DAPO).

DAPO drops the KL term (algorithm.use_kl_loss false); the estimators stay for ablations
and GRPO baselines. Each returns a per-token value to be reduced with `agg_loss`, like
the policy loss. With d = log pi - log pi_ref (Schulman's "Approximating KL"):
- "k1": d, unbiased but high variance and can be negative;
- "k2": d^2 / 2, biased, low variance;
- "k3" / "low_var_kl": exp(-d) + d - 1, unbiased and non-negative; d is clamped to
  +-20 before exp and the result to [-10, 10], as verl does, so one wild token cannot
  dominate the batch;
- "abs": |d|.
"""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3", "low_var_kl", "abs")
"""Accepted values of `kind` (config key algorithm.kl_loss_type)."""


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.

    Args:
        log_prob: [B, T] log-probs under the actor (grad flows).
        ref_log_prob: [B, T] log-probs under the reference policy.
        kind: one of `KL_KINDS`.

    Returns:
        [B, T] per-token KL estimate; reduce it with `agg_loss` and the response mask.
    """
    diff = log_prob - ref_log_prob
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        neg_diff = torch.clamp(-diff, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(neg_diff) - neg_diff - 1.0, min=-10.0, max=10.0)
    if kind == "abs":
        return diff.abs()
    raise ValueError(
        f"unknown KL estimator {kind!r} (algorithm.kl_loss_type); use one of {', '.join(KL_KINDS)}"
    )
