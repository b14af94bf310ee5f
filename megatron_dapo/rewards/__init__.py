"""Rewards (step 2 of the RL step): the DAPO math verifier, named reward functions, and
the process pool that scores a batch with a timeout on every call."""

from megatron_dapo.rewards.math_dapo import compute_score
from megatron_dapo.rewards.pool import RewardPool, RewardStats
from megatron_dapo.rewards.registry import DEFAULT_REWARD_FN, RewardFn, get_reward_fn

__all__ = ["DEFAULT_REWARD_FN", "RewardFn", "RewardPool", "RewardStats", "compute_score", "get_reward_fn"]
