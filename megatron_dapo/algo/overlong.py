"""Overlong reward shaping and overlong filtering (DAPO section 3.4), used in step 2.

Truncated responses are not necessarily wrong, so a flat -1 for them injects reward
noise. DAPO softens it: no penalty up to L_max - L_cache tokens, a penalty growing
linearly to -1 across the last L_cache tokens, and -1 from L_max on; it is scaled by a
factor and added to the rule-based reward:

    R_len(L) = 0                                  if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
             = -1                                 if L > L_max

Overlong filtering is the harder alternative: truncated responses keep their reward
for the group statistics but contribute no loss.
"""

from __future__ import annotations

import torch


def soft_overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    buffer_len: int,
    penalty_factor: float,
) -> torch.Tensor:
    """DAPO's soft length penalty, to be added to each response's reward.

    Args:
        response_lengths: [N] generated tokens per response (int or float).
        max_response_length: L_max, the generation limit (data.max_response_length).
        buffer_len: L_cache, the length of the penalty ramp (reward.overlong_buffer.len).
        penalty_factor: the penalty at L_max (reward.overlong_buffer.penalty_factor, paper 1.0).

    Returns:
        [N] float32 penalties in [-penalty_factor, 0]: 0 up to L_max - L_cache, -penalty_factor
        at L_max and beyond.
    """
    if not 0 < buffer_len < max_response_length:
        raise ValueError(
            f"reward.overlong_buffer.len={buffer_len} must be > 0 and < data.max_response_length="
            f"{max_response_length}, so that responses of up to {max_response_length} - len tokens go "
            "unpunished; shrink the buffer (the paper: 4096 of 20480) or disable it with "
            "reward.overlong_buffer.enable=false"
        )
    if penalty_factor < 0:
        raise ValueError(
            f"reward.overlong_buffer.penalty_factor={penalty_factor} must be >= 0 (the paper uses 1.0)"
        )
    expected_len = max_response_length - buffer_len
    lengths = response_lengths.to(torch.float32)
    ramp = (expected_len - lengths) / buffer_len
    return torch.clamp(ramp, min=-1.0, max=0.0) * penalty_factor


def overlong_filter_mask(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Zero the loss mask of truncated responses (finish reason "length").

    Args:
        response_mask: [B, T] bool or 0/1 loss mask.
        truncated: [B] bool, True where generation stopped at the length limit.

    Returns:
        [B, T] mask of `response_mask`'s dtype with the rows of truncated responses zeroed.
    """
    if truncated.shape != response_mask.shape[:1]:
        raise ValueError(
            f"truncated {tuple(truncated.shape)} must have one flag per row of response_mask "
            f"{tuple(response_mask.shape)}"
        )
    keep = ~truncated.bool().unsqueeze(-1)  # [B, 1]
    return torch.where(keep, response_mask, torch.zeros_like(response_mask))
