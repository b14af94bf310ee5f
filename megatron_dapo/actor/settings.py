"""What one update needs besides the batch and the objective: the lr schedule and the optimizer config."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.optimizer import OptimizerConfig

from megatron_dapo.config import OptimConfig

__all__ = ["LR_DECAY_STYLES", "LRSchedule", "make_optimizer_config"]


LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(kw_only=True, slots=True)
class LRSchedule:
    """Linear warm-up over `warmup_steps` optimizer steps, then constant (the DAPO paper) or a
    linear / cosine decay to `min_lr_ratio` x lr at optimizer step `decay_steps` (Megatron's
    lr_decay_style, verl's lr_scheduler_type with min_lr_ratio), constant after it."""

    lr: float
    """Learning rate after warm-up."""
    warmup_steps: int = 0
    """Steps of warm-up; update k (0-based) uses lr x (k + 1) / warmup_steps, so none is wasted at 0."""
    decay_style: str = "constant"
    """constant | linear | cosine (LR_DECAY_STYLES)."""
    decay_steps: int = 0
    """The optimizer step at which the decay reaches its floor (warm-up included)."""
    min_lr_ratio: float = 0.0
    """The floor, as a fraction of lr."""
    num_steps: int = 0
    """Optimizer steps taken so far (checkpointed)."""

    def __post_init__(self) -> None:
        if self.decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"decay_style={self.decay_style!r}: choose one of {', '.join(LR_DECAY_STYLES)}")

    def current(self) -> float:
        """The learning rate of the next optimizer step."""
        if self.num_steps < self.warmup_steps:
            return self.lr * (self.num_steps + 1) / self.warmup_steps
        span = self.decay_steps - self.warmup_steps
        if self.decay_style == "constant" or span <= 0:
            return self.lr
        progress = min(1.0, (self.num_steps - self.warmup_steps) / span)
        shape = 1.0 - progress if self.decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape)

    def state_dict(self) -> dict[str, float | int]:
        """What a checkpoint stores (the schedule's position and shape)."""
        return {"lr": self.lr, "warmup_steps": self.warmup_steps, "num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Resume the schedule's position; lr, warm-up and decay stay as configured for this run."""
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
