"""The DAPO algorithm core: pure torch, no torch.distributed, no megatron.

Everything here is a function of tensors and scalars; cross-rank totals (the global
token and sequence counts of a mini-batch) come in as arguments. The controller uses
overlong shaping, dynamic sampling and advantages (steps 2-4 of DESIGN.md); the actor
uses the policy loss, its aggregation and the KL estimators (step 6).
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
from megatron_dapo.algo.overlong import overlong_filter_mask, soft_overlong_penalty
from megatron_dapo.algo.policy_loss import compute_policy_loss

__all__ = [
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "DynamicSamplingBuffer",
    "DynamicSamplingError",
    "GroupFilterStats",
    "RoundStats",
    "agg_loss",
    "compute_group_advantages",
    "compute_policy_loss",
    "count_tokens_and_seqs",
    "filter_groups",
    "kl_penalty",
    "overlong_filter_mask",
    "soft_overlong_penalty",
]
