"""The `algorithm` section: the policy objective (clip ratios, aggregation, KL), dynamic
sampling's filter and the rollout correction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from megatron_dapo.config.distill import DistillConfig
from megatron_dapo.config.fields import _check
from megatron_dapo.config.policy_loss import LOSS_MODE_SPECS, PolicyLossConfig

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
"""algorithm.loss_agg_mode; the same modes as megatron_dapo.algo.LOSS_AGG_MODES, which the actor checks."""


LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


@dataclass(kw_only=True, slots=True)
class RolloutCorrectionConfig:
    """Importance sampling / rejection between the engine's log-probs and the trainer's (DESIGN.md)."""

    rollout_is: Literal["token", "sequence", "geometric"] | None = None
    """IS weights pi_old / pi_rollout: per token (TIS), per sequence (product) or its geometric mean."""
    rollout_is_threshold: float = 2.0
    """IS weights are truncated at this value."""
    rollout_rs: Literal["token", "sequence", "geometric"] | None = None
    """Rejection: tokens or sequences whose ratio is outside [lower, upper] leave the loss."""
    rollout_rs_threshold: float | None = None
    """RS upper bound; null = rollout_is_threshold."""
    rollout_rs_threshold_lower: float | None = None
    """RS lower bound; null = 1 / upper."""
    bypass_mode: bool = False
    """Use the engine's log-probs as the old policy: no recomputation, PPO clips against pi_rollout."""
    allow_uncorrected_staleness: bool = False
    """With trainer.max_staleness > 0 and none of the three above, the update treats responses of
    older weights as its own (a biased gradient); refused unless this says it is intended (an ablation)."""

    def __post_init__(self) -> None:
        _check(self.rollout_is_threshold > 0, "rollout_is_threshold", "must be > 0")
        if self.rollout_rs_threshold is not None:
            _check(self.rollout_rs_threshold > 0, "rollout_rs_threshold", "must be > 0")
        lower, upper = self.rs_bounds
        _check(0 <= lower < upper, "rollout_rs_threshold_lower", f"must be in [0, upper={upper})")
        if self.bypass_mode:
            _check(self.rollout_is is None and self.rollout_rs is None, "bypass_mode",
                   "uses the engine's log-probs as the old policy, so every IS/RS ratio is 1; unset "
                   "rollout_is and rollout_rs, or set bypass_mode=false")

    @property
    def corrects_staleness(self) -> bool:
        """Whether the update weighs or clips against the engine's log-probs (IS, RS or bypass)."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """(lower, upper) of rejection sampling with the defaults resolved."""
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return lower, upper


@dataclass(kw_only=True, slots=True)
class FilterGroupsConfig:
    """Dynamic sampling: drop groups whose metric has zero spread, generate until full."""

    enable: bool = True
    """Turn dynamic sampling on (DAPO) or off (GRPO)."""
    metric: Literal["acc", "score", "seq_reward"] = "acc"
    """Per-response value whose spread within a group decides keep/drop."""
    max_num_gen_batches: int = 10
    """Generation rounds per step before giving up with an error; 0 = unlimited. Streaming
    allows max_num_gen_batches x data.gen_batch_size prompts per step."""
    mode: Literal["streaming", "rounds"] = "streaming"
    """streaming (slime): data.gen_batch_size prompts in flight, each group scored and filtered as
    soon as its n responses are done, the rest aborted once the batch is full; rounds (verl's
    DAPO recipe): whole rounds of gen_batch_size prompts, generate, score, filter, repeat."""

    def __post_init__(self) -> None:
        _check(self.max_num_gen_batches >= 0, "max_num_gen_batches", "must be >= 0 (0 = unlimited)")


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """DAPO / GRPO policy objective."""

    adv_estimator: Literal["grpo"] = "grpo"
    """Group-relative advantage (the only estimator DAPO uses)."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group's std (GRPO/DAPO); false = Dr.GRPO."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The objective (loss_mode: vanilla = DAPO's) and each mode's own parameters."""
    clip_ratio_low: float | None = None
    """epsilon_low: the ratio is clipped below at 1 - epsilon_low; null = the loss mode's paper
    value (vanilla: DAPO's 0.2, gspo 3e-4, cispo 1.0 = no lower bound, geo_mean 0.4, clip_cov 0.2)."""
    clip_ratio_high: float | None = None
    """epsilon_high (Clip-Higher); null = the mode's (vanilla 0.28, gspo 4e-4, cispo 0.28, geo_mean 0.4,
    clip_cov 0.2). sapo and kl_cov clip no ratio and take neither."""
    clip_ratio_c: float | None = 10.0
    """Dual-clip bound for negative advantages (> 1), null = off; used by vanilla and clip_cov only."""
    loss_agg_mode: LossAggMode | None = None
    """Loss aggregation: token-mean (DAPO, global over the mini-batch) or the GRPO-style modes;
    null = the loss mode's (vanilla, cispo, clip_cov, kl_cov: token-mean; gspo, sapo, geo_mean:
    seq-mean-token-mean, the only one their papers define)."""
    loss_scale_factor: float | None = None
    """Constant divisor of seq-mean-token-sum-norm (Dr.GRPO's MAX_TOKENS); null = data.max_response_length."""
    use_kl_loss: bool = False
    """Add a KL term against the initial policy (DAPO: off)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL term."""
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl", "abs"] = "low_var_kl"
    """KL estimator."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (0 = off)."""
    overlong_filtering: bool = False
    """Mask the loss of truncated responses (finish reason length)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """Dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Engine/trainer mismatch correction (verl's names); all off = mismatch metrics only."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a frozen teacher (off unless distill.teacher is set)."""
    routing_replay: Literal["off", "rollout", "old_policy"] = "off"
    """MoE routing replay (DESIGN.md): rollout = the actor's passes route every token to the
    experts the engine chose (R3); old_policy = the update replays the routes of the
    old-log-prob pass (R2); off = every pass routes afresh (the routes are still compared)."""

    @property
    def clip_ratios(self) -> tuple[float | None, float | None]:
        """(clip_ratio_low, clip_ratio_high) with null resolved to the loss mode's defaults."""
        spec = self.policy_loss.spec
        low = self.clip_ratio_low if self.clip_ratio_low is not None else spec.clip_ratio_low
        high = self.clip_ratio_high if self.clip_ratio_high is not None else spec.clip_ratio_high
        return low, high

    @property
    def agg_mode(self) -> str:
        """loss_agg_mode with null resolved to the loss mode's default."""
        return self.loss_agg_mode if self.loss_agg_mode is not None else self.policy_loss.spec.agg_modes[0]

    def __post_init__(self) -> None:
        mode = self.policy_loss.loss_mode
        spec = LOSS_MODE_SPECS[mode]
        for key, value in (("clip_ratio_low", self.clip_ratio_low), ("clip_ratio_high", self.clip_ratio_high)):
            _check(value is None or spec.clip_ratio_low is not None, key,
                   f"is set but policy_loss.loss_mode={mode} clips no ratio; set it to null")
        if self.clip_ratio_low is not None:
            _check(0 < self.clip_ratio_low <= 1, "clip_ratio_low", "must be in (0, 1]; DAPO uses 0.2")
        if self.clip_ratio_high is not None:
            _check(0 < self.clip_ratio_high < 10, "clip_ratio_high", "must be in (0, 10); DAPO uses 0.28")
        if self.loss_agg_mode is not None:
            _check(self.loss_agg_mode in spec.agg_modes, "loss_agg_mode",
                   f"is not what policy_loss.loss_mode={mode} allows ({', '.join(spec.agg_modes)}, "
                   f"its paper's); set it to one of those or to null")
        if self.clip_ratio_c is not None:
            _check(self.clip_ratio_c > 1, "clip_ratio_c", "must be > 1 (or null to disable dual clip)")
        _check(self.kl_loss_coef >= 0, "kl_loss_coef", "must be >= 0")
        if self.loss_scale_factor is not None:
            _check(self.loss_scale_factor > 0, "loss_scale_factor", "must be > 0 (or null = data.max_response_length)")
        if self.kl_loss_coef > 0:
            _check(self.use_kl_loss, "kl_loss_coef", "is > 0 but use_kl_loss is false; set use_kl_loss=true")
        _check(self.entropy_coeff >= 0, "entropy_coeff", "must be >= 0")
