"""One step's training batch (DESIGN.md steps 1-4): `collect_batch`, what the trainer calls.

Without dynamic sampling one round of `train_batch_size` prompts is the batch; with it,
verl's rounds (rounds.py) or streaming (streaming.py, the default). Then group-relative
advantages over the shaped rewards, and the step's metrics under verl's names.
"""

from __future__ import annotations

import time

from megatron_dapo.collect.carry import CollectState
from megatron_dapo.collect.rounds import collect_rounds
from megatron_dapo.collect.scoring import assign_advantages, batch_metrics
from megatron_dapo.collect.streaming import collect_streaming
from megatron_dapo.collect.types import CollectSettings, Group
from megatron_dapo.data.datasets import PromptSampler
from megatron_dapo.data.tokenizer import Tokenizer
from megatron_dapo.rewards.pool import RewardPool
from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.tools.episode import episode_metrics
from megatron_dapo.tools.outcomes import call_outcome_metrics


def collect_batch(
    sampler: PromptSampler,
    step: int,
    *,
    rollout: RolloutController,
    rewards: RewardPool,
    tokenizer: Tokenizer,
    settings: CollectSettings,
    state: CollectState | None = None,
) -> tuple[list[Group], dict[str, float]]:
    """Generate and filter until a training batch of kept groups is full (steps 1-4).

    Args:
        sampler: the training prompts, in resumable order.
        step: the RL step (seeds the sampling).
        state: streaming's carry-over between steps (updated here); None = a fresh one.

    Returns:
        Exactly `train_batch_size` groups of `n` samples with advantages, and the metrics
        of the step (critic/*, response_length/*, train/num_gen_batches, filter counts,
        timing_s/fill, rollout/aborted_tokens, rollout/generated_tokens_per_kept_group).

    Raises:
        DynamicSamplingError: the prompt budget (`max_num_gen_batches` rounds' worth) did
            not fill the batch.
    """
    start = time.perf_counter()
    if settings.filter_enable and settings.streaming:
        batch, generated, counts = collect_streaming(
            sampler, step, rollout=rollout, rewards=rewards, tokenizer=tokenizer, settings=settings,
            state=state if state is not None else CollectState())
    else:
        batch, generated, counts = collect_rounds(
            sampler, step, rollout=rollout, rewards=rewards, tokenizer=tokenizer, settings=settings)
        counts["timing_s/fill"] = time.perf_counter() - start
        # Every generated token, dropped groups included: the compute an equal-budget ablation compares.
        counts["train/num_generated_tokens"] = float(sum(len(s.response_ids) for g in generated for s in g.samples))
        counts["rollout/aborted_tokens"] = 0.0
    assign_advantages(batch, settings.norm_adv_by_std)
    metrics = batch_metrics(batch, settings.max_response_length)
    metrics.update(counts)
    metrics["train/num_groups_generated"] = float(len(generated))
    metrics.update(episode_metrics([s.episode for g in generated for s in g.samples]))
    metrics.update(call_outcome_metrics(generated, batch))
    metrics["rollout/generated_tokens_per_kept_group"] = metrics["train/num_generated_tokens"] / len(batch)
    # Accuracy over everything generated this step: the policy's real accuracy, before
    # dynamic sampling removed the all-correct and all-wrong groups.
    all_samples = [s for g in generated for s in g.samples]
    metrics["train/acc_all_generated"] = sum(s.acc for s in all_samples) / len(all_samples)
    accs = [sum(s.acc for s in g.samples) / len(g.samples) for g in batch]
    metrics["train/kept_group_acc_min"] = min(accs)
    metrics["train/kept_group_acc_max"] = max(accs)
    metrics["train/num_groups"] = float(len(batch))
    metrics["train/num_responses"] = float(sum(len(g.samples) for g in batch))
    return batch, metrics
