"""What one update needs besides the batch: the loss settings, the lr schedule, the optimizer config."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.optimizer import OptimizerConfig

from megatron_dapo.algo import LOSS_AGG_MODES
from megatron_dapo.config import AlgorithmConfig, OptimConfig

__all__ = ["LossSettings", "WarmupConstantLR", "make_optimizer_config"]


@dataclass(kw_only=True, slots=True)
class LossSettings:
    """What the DAPO loss of one update needs (from algorithm.* and rollout.temperature)."""

    clip_ratio_low: float = 0.2
    """eps_low of Clip-Higher."""
    clip_ratio_high: float = 0.28
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
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r} (algorithm.loss_agg_mode) is not one of "
                             f"{', '.join(LOSS_AGG_MODES)}")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} (rollout.temperature) must be > 0 for the actor; "
                             "greedy rollouts cannot be trained on")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and not (self.loss_scale_factor or 0) > 0:
            raise ValueError(f"loss_scale_factor={self.loss_scale_factor} (algorithm.loss_scale_factor): "
                             "seq-mean-token-sum-norm needs a constant > 0, e.g. the maximum response length")

    @classmethod
    def from_config(cls, algorithm: AlgorithmConfig, temperature: float, max_response_length: int) -> LossSettings:
        """Settings from the algorithm section, the rollout temperature and data.max_response_length.

        seq-mean-token-sum-norm divides by algorithm.loss_scale_factor, or by
        max_response_length when that is null: a constant, like Dr.GRPO's MAX_TOKENS.
        """
        scale = algorithm.loss_scale_factor if algorithm.loss_scale_factor is not None else float(max_response_length)
        return cls(
            clip_ratio_low=algorithm.clip_ratio_low, clip_ratio_high=algorithm.clip_ratio_high,
            clip_ratio_c=algorithm.clip_ratio_c, loss_agg_mode=algorithm.loss_agg_mode,
            entropy_coeff=algorithm.entropy_coeff, use_kl_loss=algorithm.use_kl_loss,
            kl_loss_coef=algorithm.kl_loss_coef, kl_loss_type=algorithm.kl_loss_type, temperature=temperature,
            loss_scale_factor=scale,
        )


@dataclass(kw_only=True, slots=True)
class WarmupConstantLR:
    """Linear warm-up over `warmup_steps` optimizer steps, then constant (the DAPO paper)."""

    lr: float
    """Learning rate after warm-up."""
    warmup_steps: int = 0
    """Steps of warm-up; update k (0-based) uses lr x (k + 1) / warmup_steps, so none is wasted at 0."""
    num_steps: int = 0
    """Optimizer steps taken so far (checkpointed)."""

    def current(self) -> float:
        """The learning rate of the next optimizer step."""
        if self.num_steps >= self.warmup_steps:
            return self.lr
        return self.lr * (self.num_steps + 1) / self.warmup_steps

    def state_dict(self) -> dict[str, float | int]:
        """What a checkpoint stores (the schedule's position and shape)."""
        return {"lr": self.lr, "warmup_steps": self.warmup_steps, "num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Resume the schedule's position; lr and warm-up stay as configured for this run."""
        self.num_steps = int(state["num_steps"])


def make_optimizer_config(optim: OptimConfig, *, dtype: torch.dtype, use_distributed_optimizer: bool) -> OptimizerConfig:
    """megatron-core OptimizerConfig for AdamW from the optim section.

    Args:
        optim: the optim section (lr, weight decay, betas, eps, clip).
        dtype: parameter dtype; bf16 keeps fp32 master weights and fp32 gradients.
        use_distributed_optimizer: shard optimizer state over data-parallel ranks.

    Returns:
        The OptimizerConfig (optimizer "adam" with decoupled weight decay = AdamW).
    """
    return OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        # clip 0 = off; an infinite bound still has megatron compute (and report) the norm.
        clip_grad=optim.clip_grad if optim.clip_grad > 0 else math.inf,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        use_distributed_optimizer=use_distributed_optimizer,
    )
