"""On-policy distillation: the teacher's per-token signal as an advantage (DESIGN.md).

For each policy token y_t of a sampled response (tool tokens, prompts and padding are
outside `mask`), with the student's sampling log-prob log pi_s(y_t) and the frozen
teacher's log pi_T(y_t):

    A_t = reward_weight x A_task,t - coef x (log pi_s(y_t) - log pi_T(y_t))

log pi_s - log pi_T is the one-sample estimate of the per-token reverse KL
KL(pi_s || pi_T) along the student's own trajectory; as a negative advantage it pushes
the student towards what the teacher would have said at every position (dense, per-token
credit), and it goes through the same ratio clip, rollout correction and aggregation as the
task advantage. An advantage rather than a loss term: the sampled reverse KL's gradient is
a policy gradient (the samples depend on the student), so it belongs in the advantage
with the ratio, not differentiated through log pi_s alone.
"""

from __future__ import annotations

import torch

__all__ = ["distill_advantages"]


def distill_advantages(advantages: torch.Tensor, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                       mask: torch.Tensor, *, coef: float, reward_weight: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages with the teacher's reverse-KL term, and the local metric sums.

    Args:
        advantages: [B, S] the task's per-token advantages (the group-relative advantage of each row).
        student_log_probs: [B, S] log pi_s of the sampled tokens (the engine's sampling log-probs).
        teacher_log_probs: [B, S] log pi_T of the same tokens.
        mask: [B, S] bool, the policy tokens (tool tokens excluded).
        coef: weight of the reverse-KL advantage (> 0).
        reward_weight: weight of the task advantage (0 = pure distillation).

    Returns:
        (advantages [B, S] float32, 0 outside `mask`; sums float64 [3] on the CPU: reverse KL
        and teacher log-prob summed over `mask`, and the token count), to all-reduce over
        data-parallel ranks for distill/reverse_kl and distill/teacher_logprob.
    """
    mask = mask.bool()
    reverse_kl = torch.where(mask, student_log_probs.float() - teacher_log_probs.float(), 0.0)
    out = torch.where(mask, reward_weight * advantages.float() - coef * reverse_kl, 0.0)
    teacher = torch.where(mask, teacher_log_probs.float(), 0.0)
    sums = torch.stack([reverse_kl.double().sum(), teacher.double().sum(), mask.sum().double()]).cpu()
    return out, sums
