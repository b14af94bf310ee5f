"""The `reward` section: the verifier or a custom function, its worker pool, overlong shaping."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_dapo.config.fields import _check


@dataclass(kw_only=True, slots=True)
class OverlongBufferConfig:
    """Soft overlong punishment: linear penalty over the last `len` tokens before L_max."""

    enable: bool = True
    """Add the length penalty to the reward."""
    len: int = 4096
    """Buffer length L_cache; must be < data.max_response_length."""
    penalty_factor: float = 1.0
    """Penalty at L_max (the paper: 1.0)."""

    def __post_init__(self) -> None:
        _check(self.len > 0, "len", "must be > 0")
        _check(self.penalty_factor >= 0, "penalty_factor", "must be >= 0")


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Rule-based reward."""

    reward_fn: str = "math_dapo"
    """Built-in name or a user 'package.module:function' returning a float or {score, acc}."""
    num_workers: int = 4
    """Scoring processes (0 = in-process, no timeout)."""
    timeout_s: float = 10.0
    """Per-response scoring timeout; a timeout or crash scores -1 and is counted."""
    max_failure_fraction: float = 0.5
    """Stop the run with the reward's own error once more than this share of a batch's calls
    failed (raised, timed out, killed their worker), counted from 16 calls on; 1.0 = never."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """Overlong reward shaping."""

    def __post_init__(self) -> None:
        _check(bool(self.reward_fn), "reward_fn", "is empty: use 'math_dapo' or 'package.module:function'")
        _check(self.num_workers >= 0, "num_workers", "must be >= 0")
        _check(0 < self.max_failure_fraction <= 1, "max_failure_fraction", "must be in (0, 1] (1.0 = never stop)")
        _check(self.timeout_s > 0, "timeout_s", "must be > 0")
