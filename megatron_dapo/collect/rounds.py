"""verl's round-based dynamic sampling (`algorithm.filter_groups.mode: rounds`).

Rounds of `gen_batch_size` prompts are generated, scored and filtered until
`train_batch_size` groups with spread are kept; the last round's surplus is dropped (as
the paper). Each round samples with its own seed from (trainer.seed, step, round), so a
run is reproducible and a resumed step regenerates what the uninterrupted one did.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_dapo.algo import DynamicSamplingBuffer
from megatron_dapo.collect.scoring import (
    apply_overlong_penalty,
    count_dropped,
    generate_and_score,
    new_counts,
)
from megatron_dapo.collect.types import CollectSettings, Group
from megatron_dapo.data.datasets import PromptSampler
from megatron_dapo.data.tokenizer import Tokenizer
from megatron_dapo.rewards.pool import RewardPool
from megatron_dapo.rollout.controller import RolloutController


def round_seed(base_seed: int | None, step: int, round_index: int) -> int | None:
    """Sampling seed of one generation round: distinct per (step, round), reproducible on resume."""
    if base_seed is None:
        return None
    return (base_seed * 1_000_003 + step * 1009 + round_index) % (2**31 - 1)


def collect_rounds(
    sampler: PromptSampler, step: int, *, rollout: RolloutController, rewards: RewardPool, tokenizer: Tokenizer,
    settings: CollectSettings,
) -> tuple[list[Group], list[Group], dict[str, float]]:
    """Rounds of `gen_batch_size` prompts until the buffer is full: (batch, everything generated, counts)."""
    buffer = DynamicSamplingBuffer(settings.train_batch_size, settings.max_num_gen_batches)
    generated: list[Group] = []
    counts = new_counts()
    num_rounds = 0
    while True:
        num_prompts = settings.gen_batch_size if settings.filter_enable else settings.train_batch_size
        params = replace(settings.sampling, seed=round_seed(settings.sampling.seed, step, num_rounds))
        groups, round_counts = generate_and_score(sampler.next_batch(num_prompts), rollout=rollout,
                                                  rewards=rewards, tokenizer=tokenizer, params=params,
                                                  episodes=settings.episodes)
        num_rounds += 1
        for k, v in round_counts.items():
            counts[k] += v
        apply_overlong_penalty(groups, settings)
        generated.extend(groups)
        if not settings.filter_enable:
            batch = groups
            break
        stats = buffer.add_round(groups, [g.metric(settings.filter_metric) for g in groups])
        count_dropped(counts, stats)
        if buffer.is_full:
            batch = buffer.take()
            break
    counts["train/num_gen_batches"] = float(num_rounds)
    return batch, generated, counts
