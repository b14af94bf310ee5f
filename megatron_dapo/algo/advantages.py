"""Group-relative advantages (GRPO/DAPO), computed by the controller in step 4.

Each prompt is answered G times; a response's advantage is its reward relative to its
siblings: A_i = (R_i - mean_g) / (std_g + eps), the same value for every token of the
response. std_g is the unbiased sample std (divisor G - 1), as torch.std and verl's
GRPO use. With norm_by_std=False the division is skipped (Dr.GRPO, arXiv 2503.20783),
which removes the bias toward groups with low reward spread.

A group of one has no sibling to compare with, so its advantage is 0 (verl instead
passes its raw reward through); dynamic sampling never keeps such a group anyway.
The computation is a handful of scatter operations over all groups at once.
"""

from __future__ import annotations

import torch


def compute_group_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """Normalise each response's score against the other responses to the same prompt.

    Args:
        scores: [N] float, one scalar reward per response (overlong shaping included).
        group_index: [N] integer id of each response's prompt; ids may be any integers, in
            any order, not necessarily contiguous.
        eps: added to the std so that constant groups divide by eps, not by 0 (their
            numerator is 0, so their advantage is 0).
        norm_by_std: divide by std + eps (GRPO/DAPO); False gives R - mean (Dr.GRPO).

    Returns:
        [N] advantages, dtype of `scores`; 0 for responses whose group has one member.
    """
    if scores.dim() != 1 or scores.shape != group_index.shape:
        raise ValueError(
            f"scores {tuple(scores.shape)} and group_index {tuple(group_index.shape)} must be "
            "1-D of the same length: one score and one prompt id per response"
        )
    if group_index.dtype.is_floating_point or group_index.dtype == torch.bool:
        raise ValueError(f"group_index must hold integer prompt ids, got dtype {group_index.dtype}")
    if scores.numel() == 0:
        return scores.clone()

    # float64: the mean is subtracted before squaring (two-pass), and rewards are few, so
    # exactness is cheap and keeps constant groups at exactly 0.
    values = scores.detach().to(torch.float64)
    _, inverse = torch.unique(group_index, return_inverse=True)  # [N] -> group slot in [0, G)
    num_groups = int(inverse.max()) + 1
    counts = torch.bincount(inverse, minlength=num_groups).to(torch.float64)  # [G]
    sums = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(0, inverse, values)
    deviations = values - (sums / counts)[inverse]  # [N]
    advantages = deviations
    if norm_by_std:
        squares = torch.zeros_like(sums).index_add_(0, inverse, deviations.square())
        std = (squares / (counts - 1).clamp(min=1)).sqrt()  # [G], unbiased
        advantages = deviations / (std[inverse] + eps)
    advantages = torch.where(counts[inverse] > 1, advantages, torch.zeros_like(advantages))
    return advantages.to(scores.dtype)
