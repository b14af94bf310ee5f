"""The policy objective of one update (step 6): the DAPO loss and its metrics, from log-probs.

The actor computes per-token log-probs and entropies from its logits and hands them here
with the batch's old log-probs, advantages, masks and the mini-batch's global counts;
this module forms the loss that the actor back-propagates and the per-micro-batch metric
sums it reduces over ranks. Nothing here knows about Megatron, ranks or micro-batching:
the global token and sequence counts come in as arguments, which is what makes the
token-mean global (DESIGN.md). A new objective is a new function of the same inputs.

    loss = policy loss (settings.loss_mode: algo/loss_modes.py; vanilla = DAPO's Clip-Higher
                        surrogate; aggregated by loss_agg_mode)
           - entropy_coeff x entropy (same aggregation)
           + kl_loss_coef x KL(pi || pi_ref)      (when use_kl_loss; off in DAPO)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_dapo.algo.aggregation import LOSS_AGG_MODES, agg_loss
from megatron_dapo.algo.kl import kl_penalty
from megatron_dapo.algo.loss_inputs import ModeParams
from megatron_dapo.algo.loss_modes import POLICY_LOSS_MODES
from megatron_dapo.algo.policy_loss import compute_policy_loss

if TYPE_CHECKING:
    from megatron_dapo.config import AlgorithmConfig

__all__ = ["OBJECTIVE_METRICS", "LossSettings", "objective_metrics", "policy_objective"]

OBJECTIVE_METRICS: tuple[str, ...] = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss")
"""Order of the per-micro-batch metric sums `policy_objective` returns for vanilla; any mode's
is `LossSettings.metric_names`: pg_loss, the mode's metrics, entropy, kl_loss."""


@dataclass(kw_only=True, slots=True)
class LossSettings:
    """What the loss of one update needs (from algorithm.* and rollout.temperature)."""

    loss_mode: str = "vanilla"
    """algorithm.policy_loss.loss_mode, a key of algo.loss_modes.POLICY_LOSS_MODES."""
    params: ModeParams = field(default_factory=ModeParams)
    """The modes' own parameters (algorithm.policy_loss.*)."""
    clip_ratio_low: float | None = 0.2
    """eps_low of Clip-Higher (None for the modes that clip no ratio)."""
    clip_ratio_high: float | None = 0.28
    """eps_high of Clip-Higher."""
    clip_ratio_c: float | None = None
    """Dual-clip bound for negative advantages; None = off."""
    loss_agg_mode: str = "token-mean"
    """token-mean (DAPO, global over the mini-batch) or a seq-* mode."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    use_kl_loss: bool = False
    """Add kl_loss_coef x KL(pi || pi_ref); needs ref_log_probs in the batch."""
    kl_loss_coef: float = 0.0
    """Weight of the KL term."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator (see algo.kl)."""
    temperature: float = 1.0
    """Rollout sampling temperature: the policy is softmax(logits / temperature)."""
    loss_scale_factor: float | None = None
    """Constant divisor of seq-mean-token-sum-norm (required in that mode); unused by the others."""

    def __post_init__(self) -> None:
        if self.loss_mode not in POLICY_LOSS_MODES:
            raise ValueError(f"loss_mode={self.loss_mode!r} (algorithm.policy_loss.loss_mode) is not one of "
                             f"{', '.join(POLICY_LOSS_MODES)}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r} (algorithm.loss_agg_mode) is not one of "
                             f"{', '.join(LOSS_AGG_MODES)}")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} (rollout.temperature) must be > 0 for the actor; "
                             "greedy rollouts cannot be trained on")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and not (self.loss_scale_factor or 0) > 0:
            raise ValueError(f"loss_scale_factor={self.loss_scale_factor} (algorithm.loss_scale_factor): "
                             "seq-mean-token-sum-norm needs a constant > 0, e.g. the maximum response length")

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Order of the metric sums `policy_objective` returns: pg_loss, the mode's, entropy, kl_loss."""
        return ("pg_loss", *POLICY_LOSS_MODES[self.loss_mode].metrics, "entropy", "kl_loss")

    @property
    def needs_entropy_grad(self) -> bool:
        """Whether the entropy is part of the loss (else it is only a metric)."""
        return self.entropy_coeff != 0

    @property
    def needs_ref_log_probs(self) -> bool:
        """Whether the batch must carry the reference policy's log-probs (the KL term)."""
        return self.use_kl_loss

    @classmethod
    def from_config(cls, algorithm: AlgorithmConfig, temperature: float, max_response_length: int) -> LossSettings:
        """Settings from the algorithm section, the rollout temperature and data.max_response_length.

        seq-mean-token-sum-norm divides by algorithm.loss_scale_factor, or by
        max_response_length when that is null: a constant, like Dr.GRPO's MAX_TOKENS.
        """
        scale = algorithm.loss_scale_factor if algorithm.loss_scale_factor is not None else float(max_response_length)
        pl = algorithm.policy_loss
        low, high = algorithm.clip_ratios
        params = ModeParams.from_config(pl)
        # The dual clip belongs to the modes with a token-level PPO clip (config/policy_loss.py).
        clip_c = algorithm.clip_ratio_c if pl.spec.dual_clip else None
        return cls(
            loss_mode=pl.loss_mode, params=params,
            clip_ratio_low=low, clip_ratio_high=high,
            clip_ratio_c=clip_c, loss_agg_mode=algorithm.agg_mode,
            entropy_coeff=algorithm.entropy_coeff, use_kl_loss=algorithm.use_kl_loss,
            kl_loss_coef=algorithm.kl_loss_coef, kl_loss_type=algorithm.kl_loss_type, temperature=temperature,
            loss_scale_factor=scale,
        )


def policy_objective(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    settings: LossSettings,
    *,
    entropy: torch.Tensor,
    num_global_tokens: torch.Tensor | int,
    num_global_seqs: torch.Tensor | int,
    ref_log_prob: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of one micro-batch and its metric sums.

    Args:
        log_prob: [B, S] log pi_theta of the sampled tokens (with gradient).
        old_log_prob: [B, S] log pi_old (no gradient).
        advantages: [B, S] or [B, 1] per-token advantages.
        loss_mask: [B, S] 1 on the tokens that count.
        settings: the loss settings.
        entropy: [B, S] the policy's entropy per token (with gradient when settings.needs_entropy_grad).
        num_global_tokens: masked tokens of the whole mini-batch, over every rank.
        num_global_seqs: sequences of the whole mini-batch with any masked token, over every rank.
        ref_log_prob: [B, S] log pi_ref, required when settings.needs_ref_log_probs.
        is_weights: [B, S] rollout-correction importance weights (detached), or None.

    Returns:
        The loss (its sum over micro-batches and ranks is the mini-batch's loss) and a
        float32 vector of this micro-batch's metric sums in settings.metric_names order.
    """
    s = settings
    agg = {"loss_agg_mode": s.loss_agg_mode, "num_global_tokens": num_global_tokens,
           "num_global_seqs": num_global_seqs, "loss_scale_factor": s.loss_scale_factor}
    pg_loss, pg_metrics = compute_policy_loss(
        log_prob, old_log_prob, advantages, loss_mask, s.clip_ratio_low,
        s.clip_ratio_high, s.clip_ratio_c, is_weights=is_weights, loss_mode=s.loss_mode, params=s.params, **agg,
    )
    entropy_loss = agg_loss(entropy, loss_mask, s.loss_agg_mode, num_global_tokens, num_global_seqs,
                            s.loss_scale_factor)
    total = pg_loss - s.entropy_coeff * entropy_loss
    kl_loss = torch.zeros((), device=total.device)
    if s.use_kl_loss:
        assert ref_log_prob is not None, "use_kl_loss needs ref_log_prob"
        kl = kl_penalty(log_prob, ref_log_prob, s.kl_loss_type)
        kl_loss = agg_loss(kl, loss_mask, s.loss_agg_mode, num_global_tokens, num_global_seqs, s.loss_scale_factor)
        total = total + s.kl_loss_coef * kl_loss
    with torch.no_grad():
        entropy_mean = agg_loss(entropy, loss_mask, "token-mean", num_global_tokens)
        reduced = torch.stack([pg_loss.detach(), *pg_metrics.values(), entropy_mean, kl_loss.detach()]).float()
    return total, reduced


def objective_metrics(sums: list[float], settings: LossSettings) -> dict[str, float]:
    """verl's names for the metric sums over the mini-batch: actor/pg_loss, the mode's (vanilla:
    actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl), actor/entropy, and actor/kl_loss
    when the KL term is on."""
    metrics = {f"actor/{name}": float(value) for name, value in zip(settings.metric_names, sums, strict=True)}
    if not settings.use_kl_loss:
        del metrics["actor/kl_loss"]
    return metrics
