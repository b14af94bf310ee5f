"""The policy-loss modes (verl's `policy_loss.loss_mode` names) and their registry.

Each mode is one function of a `LossInputs` (algo/loss_inputs.py) returning per-token
losses and metrics, and one `POLICY_LOSS_MODES` entry naming its metrics; the
configuration side of a mode (allowed aggregations, default clip bounds) is its
`LossModeSpec` in config/policy_loss.py. Nothing outside algo/ and config/ knows a mode's
name. Per token, with r = pi_theta / pi_old (log-ratio clamped to +-20) and A the advantage:

- vanilla (DAPO): max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), then the dual clip
  min(., -A c) for A < 0.
- gspo (arXiv 2507.18071, GSPO-token): s_i = exp(mean_t log r_it) over the sequence's loss
  tokens; s_it = sg[s_i] * pi_theta / sg[pi_theta] (log clamped at 10), clipped like vanilla
  without the dual clip: every token of a sequence carries the same value and the gradient
  of the sequence's mean log-prob.
- cispo (arXiv 2506.13585): -sg[clip(r, 1 - eps_low, 1 + eps_high)] A log pi_theta.
- sapo (arXiv 2511.20347): -f(r) A with the soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau,
  tau = tau_pos for A > 0 else tau_neg.
- geo_mean (GMPO, arXiv 2507.20673): per sequence -A_i exp(mean_t sgn(A) min(sgn(A) log r,
  sgn(A) clip(log r, -eps_low, eps_high))), A_i the sequence's mean advantage; the sequence
  loss sits on each of its tokens, so seq-mean-token-mean gives its mean over sequences.
- clip_cov, kl_cov (arXiv 2505.22617): algo/cov_modes.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_dapo.algo.cov_modes import clip_cov_loss, kl_cov_loss, ppo_clip
from megatron_dapo.algo.loss_inputs import LossInputs, ModeResult

__all__ = ["POLICY_LOSS_MODES", "PolicyLossMode"]

# exp(10): verl's bound on GSPO's token ratio; past any sequence-level clip bound.
_MAX_SEQ_LOG_RATIO = 10.0


def vanilla_loss(x: LossInputs) -> ModeResult:
    pg_losses, clip_active, dual_active = ppo_clip(x, torch.exp(x.log_ratio))
    return ModeResult(pg_losses=x.weigh(pg_losses),
                      token_metrics={"pg_clipfrac": clip_active, "pg_clipfrac_lower": dual_active,
                                     "ppo_kl": -x.log_ratio})


def gspo_loss(x: LossInputs) -> ModeResult:
    seq_log_ratio = x.seq_mean(x.log_ratio).detach()  # [B] log s_i
    log_s = torch.clamp(x.log_prob - x.log_prob.detach() + seq_log_ratio.unsqueeze(-1), max=_MAX_SEQ_LOG_RATIO)
    s = torch.exp(log_s)
    unclipped = -x.advantages * s
    clipped = -x.advantages * torch.clamp(s, min=1.0 - x.clip_ratio_low, max=1.0 + x.clip_ratio_high)
    clip_active = clipped > unclipped
    pg_losses = torch.where(clip_active, clipped, unclipped)
    # With one advantage per sequence every token of it is clipped or none is: the sequence's share.
    seq_clipped = x.seq_mean(clip_active.to(x.log_prob.dtype))
    return ModeResult(pg_losses=x.weigh(pg_losses), token_metrics={"ppo_kl": -x.log_ratio},
                      seq_metrics={"pg_clipfrac": seq_clipped, "seq_ratio": torch.exp(seq_log_ratio)})


def cispo_loss(x: LossInputs) -> ModeResult:
    ratio = torch.exp(x.log_ratio)
    low, high = 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high
    weight = torch.clamp(ratio, min=low, max=high).detach()
    pg_losses = -weight * x.advantages * x.log_prob
    clipped = (ratio < low) | (ratio > high)
    return ModeResult(pg_losses=x.weigh(pg_losses), token_metrics={"pg_clipfrac": clipped, "ppo_kl": -x.log_ratio})


def sapo_loss(x: LossInputs) -> ModeResult:
    p = x.params
    ratio = torch.exp(x.log_ratio)
    tau = torch.where(x.advantages > 0, torch.full_like(ratio, p.tau_pos), torch.full_like(ratio, p.tau_neg))
    sig = torch.sigmoid(tau * (ratio - 1.0))
    pg_losses = -sig * (4.0 / tau) * x.advantages
    # d f / d r = 4 sigma (1 - sigma): 1 on-policy, falling as the ratio drifts (the soft clip).
    return ModeResult(pg_losses=x.weigh(pg_losses),
                      token_metrics={"gate_weight": (4.0 * sig * (1.0 - sig)).detach(), "ppo_kl": -x.log_ratio})


def geo_mean_loss(x: LossInputs) -> ModeResult:
    sign = torch.sign(x.advantages)
    clamped = torch.clamp(x.log_ratio, min=-x.clip_ratio_low, max=x.clip_ratio_high)
    kept = sign * torch.minimum(sign * x.log_ratio, sign * clamped)
    seq_ratio = torch.exp(x.seq_mean(kept))  # [B] geometric mean of the clipped token ratios
    seq_adv = x.seq_mean(x.advantages)
    seq_loss = -seq_adv * seq_ratio
    if x.is_weights is not None:  # verl: the sequence takes its tokens' geometric-mean weight
        w = x.is_weights.to(x.log_prob.dtype)
        seq_loss = seq_loss * torch.exp(x.seq_mean(torch.log(w + 1e-10)))
    pg_losses = seq_loss.unsqueeze(-1).expand_as(x.log_prob)
    clipped = clamped != x.log_ratio
    return ModeResult(pg_losses=pg_losses,
                      token_metrics={"pg_clipfrac": clipped & (x.advantages > 0),
                                     "pg_clipfrac_lower": clipped & (x.advantages < 0), "ppo_kl": -x.log_ratio})


@dataclass(frozen=True, slots=True)
class PolicyLossMode:
    """A registered mode: its function and the metric names it reports, in order."""

    fn: Callable[[LossInputs], ModeResult]
    metrics: tuple[str, ...]
    clips: bool = True
    """Whether it clips a ratio (then clip_ratio_low / clip_ratio_high are required)."""


POLICY_LOSS_MODES: dict[str, PolicyLossMode] = {
    "vanilla": PolicyLossMode(vanilla_loss, ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")),
    "gspo": PolicyLossMode(gspo_loss, ("pg_clipfrac", "seq_ratio", "ppo_kl")),
    "cispo": PolicyLossMode(cispo_loss, ("pg_clipfrac", "ppo_kl")),
    "sapo": PolicyLossMode(sapo_loss, ("gate_weight", "ppo_kl"), clips=False),
    "geo_mean": PolicyLossMode(geo_mean_loss, ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")),
    "clip_cov": PolicyLossMode(clip_cov_loss, ("pg_clipfrac", "pg_clipfrac_lower", "cov_selected_frac", "ppo_kl")),
    "kl_cov": PolicyLossMode(kl_cov_loss, ("cov_selected_frac", "ppo_kl"), clips=False),
}
"""loss_mode -> mode; the same names as config.LOSS_MODE_SPECS (a test holds them equal)."""
