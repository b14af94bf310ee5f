"""The controller's half of an RL step (DESIGN.md steps 1-4), on global rank 0 only.

    1. draw `gen_batch_size` prompts, generate `n` responses each (token ids in and out)
    2. score every response (reward pool with per-call timeouts) + overlong shaping
    3. dynamic sampling: keep groups whose metric has spread; repeat 1-3 until
       `train_batch_size` groups are kept (the surplus is trimmed)
    4. group-relative advantages over the shaped rewards

The result is a list of `Group`s with every `Sample` carrying its advantage, plus the
metrics of the step, under verl's names. Evaluation (avg@k on held-out prompts) reuses
the same generate-and-score path without filtering.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from megatron_dapo.algo import DynamicSamplingBuffer, compute_group_advantages, soft_overlong_penalty
from megatron_dapo.algo.dynamic_sampling import GroupFilterStats
from megatron_dapo.config import ValKwargsConfig
from megatron_dapo.data.datasets import PromptRecord, PromptSampler
from megatron_dapo.data.tokenizer import Tokenizer
from megatron_dapo.rewards.pool import RewardPool, RewardStats
from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import GenerationResult, SamplingParams


@dataclass(kw_only=True, slots=True)
class Sample:
    """One response with everything the actor and the metrics need."""

    prompt_ids: list[int]
    """Prompt token ids as sent to the engine."""
    response_ids: list[int]
    """Generated token ids (never re-tokenized)."""
    rollout_log_probs: list[float]
    """Engine log-probs of the response tokens (temperature-scaled), for rollout/actor drift."""
    finish_reason: str
    """stop, length or abort."""
    score: float = 0.0
    """Verifier score (+1 / -1)."""
    acc: bool = False
    """Verifier accuracy."""
    overlong_penalty: float = 0.0
    """Soft overlong punishment added to the score (<= 0)."""
    advantage: float = 0.0
    """Group-relative advantage of the shaped reward."""
    num_versions: int = 1
    """Weight versions its tokens were sampled under (> 1 for a continued partial rollout)."""
    weight_versions: tuple[int, ...] = ()
    """Which versions, oldest first, where the engine reports them (the asynchronous loop's
    staleness is the age of the first)."""

    @property
    def reward(self) -> float:
        """The shaped reward: score + overlong penalty."""
        return self.score + self.overlong_penalty

    @property
    def truncated(self) -> bool:
        """Whether generation stopped at the length limit."""
        return self.finish_reason == "length"


@dataclass(kw_only=True, slots=True)
class Group:
    """The n responses to one prompt."""

    prompt: PromptRecord
    """The prompt and its ground truth."""
    samples: list[Sample] = field(default_factory=list)
    """Its responses."""

    def metric(self, name: str) -> list[float]:
        """Per-response values of the dynamic-sampling metric (acc, score or seq_reward)."""
        if name == "acc":
            return [float(s.acc) for s in self.samples]
        if name == "score":
            return [s.score for s in self.samples]
        return [s.reward for s in self.samples]


@dataclass(kw_only=True, slots=True)
class CollectSettings:
    """The controller's settings for one step, taken from the config sections."""

    n: int
    """Responses per prompt (rollout.n)."""
    sampling: SamplingParams
    """Training rollout sampling (n, temperature, top_p, top_k, max_new_tokens, stop ids)."""
    gen_batch_size: int
    """Prompts per generation round (data.gen_batch_size)."""
    train_batch_size: int
    """Groups per training batch (data.train_batch_size)."""
    filter_enable: bool
    """Dynamic sampling on (algorithm.filter_groups.enable)."""
    filter_metric: str
    """Metric with spread to keep a group (algorithm.filter_groups.metric)."""
    max_num_gen_batches: int
    """Rounds before giving up (algorithm.filter_groups.max_num_gen_batches); streaming allows
    this many times gen_batch_size prompts."""
    streaming: bool = False
    """Streaming collection (algorithm.filter_groups.mode=streaming) instead of rounds."""
    partial_rollout: bool = False
    """Carry the groups a full batch's abort left incomplete into the next step (rollout.partial_rollout)."""
    partial_max_versions: int = 2
    """The most weight versions a response may span (rollout.partial_rollout_max_versions)."""
    max_response_length: int
    """L_max (data.max_response_length)."""
    overlong_enable: bool
    """Soft overlong punishment on (reward.overlong_buffer.enable)."""
    overlong_len: int
    """L_cache (reward.overlong_buffer.len)."""
    overlong_penalty_factor: float
    """Penalty at L_max (reward.overlong_buffer.penalty_factor)."""
    norm_adv_by_std: bool
    """GRPO/DAPO std normalisation (algorithm.norm_adv_by_std_in_grpo)."""


def generate_and_score(
    prompts: Sequence[PromptRecord],
    *,
    rollout: RolloutController,
    rewards: RewardPool,
    tokenizer: Tokenizer,
    params: SamplingParams,
) -> tuple[list[Group], dict[str, float]]:
    """Generate params.n responses per prompt and score them with the verifier.

    Returns:
        One Group per prompt (samples in sample order), the round's reward-pool counts and
        its generation and scoring seconds (timing_s/gen, timing_s/reward).
    """
    start = time.perf_counter()
    results: list[GenerationResult] = rollout.generate([p.prompt_ids for p in prompts], params)
    generated_at = time.perf_counter()
    groups = [Group(prompt=p) for p in prompts]
    for r in results:
        groups[r.prompt_index].samples.append(make_sample(prompts[r.prompt_index], r))
    stats = score_groups(groups, rewards=rewards, tokenizer=tokenizer)
    return groups, {"reward/num_errors": float(stats.num_errors), "reward/num_timeouts": float(stats.num_timeouts),
                    "timing_s/gen": generated_at - start, "timing_s/reward": time.perf_counter() - generated_at}


def make_sample(prompt: PromptRecord, r: GenerationResult) -> Sample:
    return Sample(prompt_ids=prompt.prompt_ids, response_ids=r.output_ids, rollout_log_probs=r.logprobs,
                  finish_reason=r.finish_reason, weight_versions=r.weight_versions)


def score_groups(groups: Sequence[Group], *, rewards: RewardPool, tokenizer: Tokenizer) -> RewardStats:
    """Score every sample of the groups with the verifier (in place)."""
    samples = [s for g in groups for s in g.samples]
    inputs = [(tokenizer.decode(s.response_ids), g.prompt.ground_truth, g.prompt.extra_info or None)
              for g in groups for s in g.samples]
    scored, stats = rewards.score_batch(inputs)
    for s, out in zip(samples, scored):
        s.score = float(out["score"])
        s.acc = bool(out["acc"])
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


def round_seed(base_seed: int | None, step: int, round_index: int) -> int | None:
    """Sampling seed of one generation round: distinct per (step, round), reproducible on resume."""
    if base_seed is None:
        return None
    return (base_seed * 1_000_003 + step * 1009 + round_index) % (2**31 - 1)


def new_counts() -> dict[str, float]:
    return {"reward/num_errors": 0.0, "reward/num_timeouts": 0.0, "timing_s/gen": 0.0, "timing_s/reward": 0.0,
            "train/num_groups_dropped_all_correct": 0.0, "train/num_groups_dropped_all_wrong": 0.0,
            "train/num_generated_tokens": 0.0}


def count_dropped(counts: dict[str, float], stats: GroupFilterStats) -> None:
    counts["train/num_groups_dropped_all_correct"] += stats.num_dropped_all_correct
    counts["train/num_groups_dropped_all_wrong"] += stats.num_dropped_all_wrong


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
                                                  rewards=rewards, tokenizer=tokenizer, params=params)
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
    }


def val_sampling_params(val_kwargs: ValKwargsConfig, *, max_new_tokens: int, eos_id: int, seed: int) -> SamplingParams:
    """The held-out evaluation's sampling (rollout.val_kwargs), seeded trainer.seed + 1.

    The trainer's validation and the warm start's accuracy checks both use it, so the first
    val/acc of a run equals the warm start's last check of the same weights.
    """
    return SamplingParams(n=val_kwargs.n, temperature=val_kwargs.temperature, top_p=val_kwargs.top_p,
                          top_k=val_kwargs.top_k, max_new_tokens=max_new_tokens, stop_token_ids=(eos_id,),
                          seed=seed + 1)


def evaluate(
    prompts: Sequence[PromptRecord],
    *,
    rollout: RolloutController,
    rewards: RewardPool,
    tokenizer: Tokenizer,
    params: SamplingParams,
) -> dict[str, Any]:
    """avg@n accuracy and score on held-out prompts (no filtering, no shaping).

    Returns:
        val/acc (avg@n, the paper's metric), val/score/mean, val/pass@n, val/response_length/mean.
    """
    groups, _ = generate_and_score(prompts, rollout=rollout, rewards=rewards, tokenizer=tokenizer, params=params)
    samples = [s for g in groups for s in g.samples]
    return {
        "val/acc": sum(s.acc for s in samples) / len(samples),
        "val/score/mean": sum(s.score for s in samples) / len(samples),
        f"val/pass@{params.n}": sum(any(s.acc for s in g.samples) for g in groups) / len(groups),
        "val/response_length/mean": sum(len(s.response_ids) for s in samples) / len(samples),
    }
