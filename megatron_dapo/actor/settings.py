"""What one update needs besides the batch and the objective: the lr schedule and the optimizer config."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.optimizer import OptimizerConfig

from megatron_dapo.config import OptimConfig

__all__ = ["WarmupConstantLR", "make_optimizer_config"]


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
