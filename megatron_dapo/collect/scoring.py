"""Steps 1-2 and 4 for a set of prompts: generate, score, shape, advantages, batch metrics.

The building blocks both collection modes (rounds.py, streaming.py) and the held-out
scoring (heldout.py) share: `generate_and_score` sends prompts to the engines and scores
every response with the reward pool; overlong shaping and group-relative advantages
modify the samples in place; `batch_metrics` names the batch's statistics as verl does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from megatron_dapo.algo import compute_group_advantages, soft_overlong_penalty
from megatron_dapo.algo.dynamic_sampling import (
    GroupFilterStats,
)
from megatron_dapo.collect.types import CollectSettings, Group, Sample
from megatron_dapo.data.datasets import PromptRecord
from megatron_dapo.data.tokenizer import Tokenizer
from megatron_dapo.rewards.pool import RewardPool, RewardStats
from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import GenerationResult, SamplingParams
from megatron_dapo.tools.episode import EpisodeRunner


def generate_and_score(
    prompts: Sequence[PromptRecord],
    *,
    rollout: RolloutController,
    rewards: RewardPool,
    tokenizer: Tokenizer,
    params: SamplingParams,
    episodes: EpisodeRunner | None = None,
) -> tuple[list[Group], dict[str, float]]:
    """Generate params.n responses per prompt (episodes with tool calls when given) and score them.

    Returns:
        One Group per prompt (samples in sample order), the round's reward-pool counts and
        its generation and scoring seconds (timing_s/gen, timing_s/reward).
    """
    start = time.perf_counter()
    prompt_ids = [p.prompt_ids for p in prompts]
    results: list[GenerationResult] = (rollout.generate(prompt_ids, params) if episodes is None
                                       else episodes.generate(rollout.generate, prompt_ids, params))
    generated_at = time.perf_counter()
    groups = [Group(prompt=p) for p in prompts]
    for r in results:
        groups[r.prompt_index].samples.append(make_sample(prompts[r.prompt_index], r))
    stats = score_groups(groups, rewards=rewards, tokenizer=tokenizer)
    return groups, {"reward/num_errors": float(stats.num_errors), "reward/num_timeouts": float(stats.num_timeouts),
                    "timing_s/gen": generated_at - start, "timing_s/reward": time.perf_counter() - generated_at}


def make_sample(prompt: PromptRecord, r: GenerationResult) -> Sample:
    return Sample(prompt_ids=prompt.prompt_ids, response_ids=r.output_ids, rollout_log_probs=r.logprobs,
                  finish_reason=r.finish_reason, weight_versions=r.weight_versions, routed_experts=r.routed_experts,
                  episode=r.episode)


def score_groups(groups: Sequence[Group], *, rewards: RewardPool, tokenizer: Tokenizer) -> RewardStats:
    """Score every sample of the groups with the verifier (in place)."""
    samples = [s for g in groups for s in g.samples]
    inputs = [(tokenizer.decode(s.response_ids), g.prompt.ground_truth, g.prompt.extra_info or None,
               g.prompt.data_source) for g in groups for s in g.samples]
    scored, stats = rewards.score_batch(inputs)
    for s, out in zip(samples, scored):
        s.score = float(out["score"])
        s.acc = bool(out["acc"])
        s.reward_extra = {k: float(v) for k, v in out.items() if k not in ("score", "acc", "error")
                          and isinstance(v, int | float) and math.isfinite(v)}
    return stats


def apply_overlong_penalty(groups: Sequence[Group], settings: CollectSettings) -> None:
    """Add DAPO's soft overlong punishment to every sample (in place)."""
    if not settings.overlong_enable:
        return
    samples = [s for g in groups for s in g.samples]
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    penalties = soft_overlong_penalty(lengths, settings.max_response_length, settings.overlong_len,
                                      settings.overlong_penalty_factor)
    for s, p in zip(samples, penalties.tolist()):
        s.overlong_penalty = p


def assign_advantages(groups: Sequence[Group], norm_by_std: bool) -> None:
    """Group-relative advantages of the shaped rewards (in place)."""
    samples = [s for g in groups for s in g.samples]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    index = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    for s, a in zip(samples, compute_group_advantages(rewards, index, norm_by_std=norm_by_std).tolist()):
        s.advantage = a


def new_counts() -> dict[str, float]:
    return {"reward/num_errors": 0.0, "reward/num_timeouts": 0.0, "timing_s/gen": 0.0, "timing_s/reward": 0.0,
            "train/num_groups_dropped_all_correct": 0.0, "train/num_groups_dropped_all_wrong": 0.0,
            "train/num_generated_tokens": 0.0}


def count_dropped(counts: dict[str, float], stats: GroupFilterStats) -> None:
    counts["train/num_groups_dropped_all_correct"] += stats.num_dropped_all_correct
    counts["train/num_groups_dropped_all_wrong"] += stats.num_dropped_all_wrong


def batch_metrics(groups: Sequence[Group], max_response_length: int) -> dict[str, float]:
    """verl-named metrics of a training batch."""
    samples = [s for g in groups for s in g.samples]
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    scores = torch.tensor([s.score for s in samples], dtype=torch.float64)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
    return {
        "critic/score/mean": float(scores.mean()),
        "critic/score/max": float(scores.max()),
        "critic/score/min": float(scores.min()),
        "critic/rewards/mean": float(rewards.mean()),
        "critic/advantages/mean": float(advantages.mean()),
        "critic/advantages/max": float(advantages.max()),
        "critic/advantages/min": float(advantages.min()),
        "train/acc": float(sum(s.acc for s in samples) / len(samples)),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float(sum(s.truncated for s in samples) / len(samples)),
        "prompt_length/mean": float(sum(len(s.prompt_ids) for s in samples) / len(samples)),
        **reward_extra_metrics(samples),
    }


def reward_extra_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """reward_extra/<key>/mean of the numbers a reward function returned beside "score" and "acc"
    (verl's extra metrics), over the samples that returned the key."""
    values: dict[str, list[float]] = {}
    for s in samples:
        for key, value in s.reward_extra.items():
            values.setdefault(key, []).append(value)
    return {f"reward_extra/{key}/mean": sum(v) / len(v) for key, v in sorted(values.items())}
