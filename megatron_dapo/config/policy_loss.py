"""`algorithm.policy_loss`: which policy-gradient objective the update uses, and its own knobs.

verl's names (verl/trainer/ppo/core_algos.py, `policy_loss.loss_mode`). The formulas are in
megatron_dapo/algo/loss_modes.py and DESIGN.md ("The policy-loss modes"); this module holds
what the configuration must know of a mode: the aggregations its paper allows, its default
clip bounds, and whether it clips a ratio at all. A new mode is one `LossModeSpec` here and
one function plus one registry entry in algo/loss_modes.py (a test holds the two tables equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from megatron_dapo.config.fields import _check

LossMode = Literal["vanilla", "gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov"]
"""algorithm.policy_loss.loss_mode."""

LOSS_MODES: tuple[str, ...] = get_args(LossMode)


@dataclass(frozen=True, slots=True)
class LossModeSpec:
    """What the configuration knows of a policy-loss mode."""

    agg_modes: tuple[str, ...]
    """The loss_agg_mode values its paper allows; the first is the default (loss_agg_mode: null)."""
    clip_ratio_low: float | None
    """Default eps_low (clip_ratio_low: null); None = the mode clips no ratio."""
    clip_ratio_high: float | None
    """Default eps_high (clip_ratio_high: null)."""
    dual_clip: bool = False
    """Whether algorithm.clip_ratio_c applies (a token-level PPO clip); other modes do not use it."""
    paper: str = ""
    """Where the defaults come from."""


_ALL_AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

LOSS_MODE_SPECS: dict[str, LossModeSpec] = {
    "vanilla": LossModeSpec(_ALL_AGG, 0.2, 0.28, dual_clip=True, paper="DAPO, arXiv 2503.14476 (Clip-Higher)"),
    "gspo": LossModeSpec(("seq-mean-token-mean",), 3e-4, 4e-4, paper="GSPO, arXiv 2507.18071 (eps 3e-4 / 4e-4)"),
    "cispo": LossModeSpec(("token-mean",), 1.0, 0.28,
                          paper="MiniMax-M1, arXiv 2506.13585 (no lower bound on the IS weight, eps_high tuned)"),
    "sapo": LossModeSpec(("seq-mean-token-mean",), None, None, paper="SAPO, arXiv 2511.20347 (tau 1.0 / 1.05)"),
    "geo_mean": LossModeSpec(("seq-mean-token-mean",), 0.4, 0.4,
                             paper="GMPO, arXiv 2507.20673 (log-ratio clipped to (-0.4, 0.4))"),
    "clip_cov": LossModeSpec(("token-mean",), 0.2, 0.2, dual_clip=True,
                             paper="Clip-Cov, arXiv 2505.22617 (r = 2e-4, cov in (1, 5))"),
    "kl_cov": LossModeSpec(("token-mean",), None, None, paper="KL-Cov, arXiv 2505.22617 (k = 2e-4, beta = 1)"),
}
assert tuple(LOSS_MODE_SPECS) == LOSS_MODES


@dataclass(kw_only=True, slots=True)
class PolicyLossConfig:
    """The policy-gradient objective (verl's actor.policy_loss) and each mode's own parameters."""

    loss_mode: LossMode = "vanilla"
    """vanilla (DAPO's Clip-Higher PPO surrogate), gspo, cispo, sapo, geo_mean (GMPO), clip_cov, kl_cov."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of a micro-batch's tokens whose gradient is cut (the paper's r)."""
    clip_cov_lb: float = 1.0
    """clip_cov: only tokens whose covariance exceeds this are candidates (omega_low)."""
    clip_cov_ub: float = 5.0
    """clip_cov: ... and is below this (omega_high)."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of a micro-batch's tokens, the largest covariances, that get the KL penalty (k)."""
    ppo_kl_coef: float = 1.0
    """kl_cov: weight of |log pi - log pi_old| on the selected tokens (beta)."""
    tau_pos: float = 1.0
    """sapo: gate temperature of tokens with a positive advantage."""
    tau_neg: float = 1.05
    """sapo: gate temperature of the others (> tau_pos: negative updates decay faster off-policy)."""

    @property
    def spec(self) -> LossModeSpec:
        return LOSS_MODE_SPECS[self.loss_mode]

    def __post_init__(self) -> None:
        _check(0 < self.clip_cov_ratio <= 1, "clip_cov_ratio", "must be in (0, 1]; the paper uses 2e-4")
        _check(self.clip_cov_lb < self.clip_cov_ub, "clip_cov_lb",
               f"must be below clip_cov_ub={self.clip_cov_ub}; the paper uses 1 and 5")
        _check(0 < self.kl_cov_ratio <= 1, "kl_cov_ratio", "must be in (0, 1]; the paper uses 2e-4")
        _check(self.ppo_kl_coef >= 0, "ppo_kl_coef", "must be >= 0; the paper uses 1")
        _check(self.tau_pos > 0, "tau_pos", "must be > 0; SAPO uses 1.0")
        _check(self.tau_neg > 0, "tau_neg", "must be > 0; SAPO uses 1.05")
