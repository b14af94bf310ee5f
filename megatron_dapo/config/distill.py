"""`algorithm.distill`: on-policy distillation from a frozen teacher (DESIGN.md "On-policy distillation").

The teacher scores every policy token of the sampled responses (tool tokens and prompts
excluded) with its own log-probs; the per-token reverse KL estimate log pi_student -
log pi_teacher enters the update as a negative per-token advantage:

    A_t = reward_weight x A_task + coef x (log pi_teacher(y_t) - log pi_student(y_t))

reward_weight 0 is pure on-policy distillation; > 0 mixes it with the task's reward.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.config.fields import _check


@dataclass(kw_only=True, slots=True)
class DistillConfig:
    """The teacher and the weights of its signal."""

    teacher: str | None = None
    """An HF checkpoint directory with the student's tokenizer (a training checkpoint: export it
    with `megatron-dapo convert` first); null = no distillation."""
    coef: float = 1.0
    """Weight of the per-token reverse-KL advantage."""
    reward_weight: float = 0.0
    """Weight of the task's group-relative advantage: 0 = pure distillation, > 0 mixes the two."""

    def __post_init__(self) -> None:
        _check(self.coef > 0, "coef", "must be > 0 (set teacher: null to turn distillation off)")
        _check(self.reward_weight >= 0, "reward_weight", "must be >= 0 (0 = pure distillation)")

    @property
    def enabled(self) -> bool:
        return self.teacher is not None
