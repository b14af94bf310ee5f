"""What every policy-loss mode receives and returns (algo/loss_modes.py, algo/cov_modes.py).

`compute_policy_loss` (algo/policy_loss.py) checks the shapes, broadcasts the advantages,
takes the log-ratio once (clamped to +-20, zero on padding so that NaN padding cannot reach
the backward pass) and hands a `LossInputs` to the mode's function. The function returns
per-token losses, already multiplied by the rollout-correction weights, and its metrics;
`compute_policy_loss` aggregates both over the mini-batch's global counts. A mode never
sees a rank, a micro-batch index or a count from outside its own rows: a sequence is one
row and never spans micro-batches (actor/microbatch.py), and under context parallelism
every CP rank computes the loss from the gathered full rows (actor/context_parallel.py),
so per-sequence sums over a row are whole-sequence sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from megatron_dapo.config.policy_loss import PolicyLossConfig

_DEFAULTS = {f.name: f.default for f in fields(PolicyLossConfig)}
"""The papers' defaults, written once: in the config (torch-free, so the config cannot import this)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModeParams:
    """The modes' own parameters (verl's algorithm.policy_loss names; defaults: PolicyLossConfig's)."""

    clip_cov_ratio: float = _DEFAULTS["clip_cov_ratio"]
    clip_cov_lb: float = _DEFAULTS["clip_cov_lb"]
    clip_cov_ub: float = _DEFAULTS["clip_cov_ub"]
    kl_cov_ratio: float = _DEFAULTS["kl_cov_ratio"]
    ppo_kl_coef: float = _DEFAULTS["ppo_kl_coef"]
    tau_pos: float = _DEFAULTS["tau_pos"]
    tau_neg: float = _DEFAULTS["tau_neg"]

    @classmethod
    def from_config(cls, config: PolicyLossConfig) -> ModeParams:
        """The same-named fields of algorithm.policy_loss."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


@dataclass(frozen=True, kw_only=True, slots=True)
class LossInputs:
    """One micro-batch's rows, prepared for a mode."""

    log_prob: torch.Tensor
    """[B, T] log pi_theta (with gradient), 0 on padding."""
    log_ratio: torch.Tensor
    """[B, T] log pi_theta - log pi_old clamped to +-20 (with gradient), 0 on padding."""
    advantages: torch.Tensor
    """[B, T] per-token advantages (the [B] form broadcast)."""
    valid: torch.Tensor
    """[B, T] bool: the tokens that carry loss (tool tokens and padding are False)."""
    clip_ratio_low: float | None
    clip_ratio_high: float | None
    clip_ratio_c: float | None
    params: ModeParams
    is_weights: torch.Tensor | None
    """[B, T] rollout-correction weights (detached), or None."""
    generator: torch.Generator | None = None
    """clip_cov's random choice; None = seeded from the micro-batch's token count, the same on
    every tensor-, pipeline- and context-parallel rank that computes this loss."""

    def weigh(self, pg_losses: torch.Tensor) -> torch.Tensor:
        """Per-token losses times the rollout-correction weights (verl's order: after the clip)."""
        return pg_losses if self.is_weights is None else pg_losses * self.is_weights.to(pg_losses.dtype)

    def seq_lengths(self) -> torch.Tensor:
        """[B] loss-carrying tokens per row, at least 1 (rows without any count for nothing)."""
        return self.valid.sum(dim=-1).clamp(min=1).to(self.log_prob.dtype)

    def seq_mean(self, values: torch.Tensor) -> torch.Tensor:
        """[B] mean of [B, T] `values` over each row's valid tokens."""
        return torch.where(self.valid, values, torch.zeros_like(values)).sum(dim=-1) / self.seq_lengths()


@dataclass(kw_only=True, slots=True)
class ModeResult:
    """A mode's per-token losses and its metrics before aggregation."""

    pg_losses: torch.Tensor
    """[B, T] per-token loss (rollout weights applied), aggregated with the loss_agg_mode."""
    token_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> [B, T] values, reported as a token mean over the mini-batch's valid tokens."""
    seq_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> [B] values, reported as a mean over the mini-batch's non-empty sequences."""
