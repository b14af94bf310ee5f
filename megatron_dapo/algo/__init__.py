"""The DAPO algorithm core: pure torch, no torch.distributed, no megatron.

Everything here is a function of tensors and scalars; cross-rank totals (the global
token and sequence counts of a mini-batch) come in as arguments. The controller uses
overlong shaping, dynamic sampling and advantages (steps 2-4 of DESIGN.md); the actor
calls the objective (objective.py: the policy loss, its aggregation, entropy and KL
terms, and their metrics) with its log-probs (step 6).
"""

from megatron_dapo.algo.advantages import compute_group_advantages
from megatron_dapo.algo.aggregation import LOSS_AGG_MODES, agg_loss, count_tokens_and_seqs
from megatron_dapo.algo.dynamic_sampling import (
    DynamicSamplingBuffer,
    DynamicSamplingError,
    GroupFilterStats,
    RoundStats,
    filter_groups,
)
from megatron_dapo.algo.kl import KL_KINDS, kl_penalty
from megatron_dapo.algo.objective import OBJECTIVE_METRICS, LossSettings, objective_metrics, policy_objective
from megatron_dapo.algo.overlong import overlong_filter_mask, soft_overlong_penalty
from megatron_dapo.algo.policy_loss import compute_policy_loss

__all__ = [
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "OBJECTIVE_METRICS",
    "DynamicSamplingBuffer",
    "DynamicSamplingError",
    "GroupFilterStats",
    "LossSettings",
    "RoundStats",
    "agg_loss",
    "compute_group_advantages",
    "compute_policy_loss",
    "count_tokens_and_seqs",
    "filter_groups",
    "kl_penalty",
    "objective_metrics",
    "overlong_filter_mask",
    "policy_objective",
    "soft_overlong_penalty",
]
