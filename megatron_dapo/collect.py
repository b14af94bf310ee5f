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

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from megatron_dapo.algo import DynamicSamplingBuffer, compute_group_advantages, soft_overlong_penalty
from megatron_dapo.algo.dynamic_sampling import DynamicSamplingError, GroupFilterStats, filter_groups
from megatron_dapo.config import ValKwargsConfig
from megatron_dapo.data.datasets import PromptRecord, PromptSampler
from megatron_dapo.data.tokenizer import Tokenizer
from megatron_dapo.rewards.pool import RewardPool, RewardStats
from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import GenerationResult, SamplingParams
from megatron_dapo.rollout.streaming import PromptFeed


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


@dataclass(kw_only=True, slots=True)
class CollectState:
    """What streaming collection carries from one step to the next (saved in checkpoints)."""

    keep_rate: float = 0.5
    """Share of the last step's finished groups that dynamic sampling kept: the prior of how many
    prompts the next step puts in flight."""

    def state_dict(self) -> dict[str, float]:
        """For the checkpoint's trainer state."""
        return {"keep_rate": self.keep_rate}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore what state_dict returned."""
        self.keep_rate = float(state["keep_rate"])


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
        groups[r.prompt_index].samples.append(_sample(prompts[r.prompt_index], r))
    stats = score_groups(groups, rewards=rewards, tokenizer=tokenizer)
    return groups, {"reward/num_errors": float(stats.num_errors), "reward/num_timeouts": float(stats.num_timeouts),
                    "timing_s/gen": generated_at - start, "timing_s/reward": time.perf_counter() - generated_at}


def _sample(prompt: PromptRecord, r: GenerationResult) -> Sample:
    return Sample(prompt_ids=prompt.prompt_ids, response_ids=r.output_ids, rollout_log_probs=r.logprobs,
                  finish_reason=r.finish_reason)


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

    Without dynamic sampling one round of `train_batch_size` prompts is the batch. With it,
    either rounds of `gen_batch_size` prompts (verl's recipe) or streaming (slime's): a
    window of `gen_batch_size` prompts in flight, each group scored and filtered as soon as
    its n responses are done, the rest aborted when the batch is full.

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
        batch, generated, aborted_tokens, counts = _collect_streaming(
            sampler, step, rollout=rollout, rewards=rewards, tokenizer=tokenizer, settings=settings,
            state=state if state is not None else CollectState())
    else:
        batch, generated, counts = _collect_rounds(
            sampler, step, rollout=rollout, rewards=rewards, tokenizer=tokenizer, settings=settings)
        aborted_tokens = 0
        counts["timing_s/fill"] = time.perf_counter() - start
    assign_advantages(batch, settings.norm_adv_by_std)
    metrics = batch_metrics(batch, settings.max_response_length)
    metrics.update(counts)
    metrics["train/num_groups_generated"] = float(len(generated))
    # Every generated token, dropped groups and aborted responses included: the compute an
    # equal-budget ablation compares.
    num_tokens = (sum(len(s.response_ids) for g in generated for s in g.samples) + aborted_tokens
                  + metrics.get("train/num_generated_tokens", 0.0))
    metrics["train/num_generated_tokens"] = float(num_tokens)
    metrics["rollout/aborted_tokens"] = float(aborted_tokens)
    metrics["rollout/generated_tokens_per_kept_group"] = num_tokens / len(batch)
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


def _new_counts() -> dict[str, float]:
    return {"reward/num_errors": 0.0, "reward/num_timeouts": 0.0, "timing_s/gen": 0.0, "timing_s/reward": 0.0,
            "train/num_groups_dropped_all_correct": 0.0, "train/num_groups_dropped_all_wrong": 0.0,
            "train/num_generated_tokens": 0.0}  # tokens of groups not in `generated` (late streaming groups)


def _count_dropped(counts: dict[str, float], stats: GroupFilterStats) -> None:
    counts["train/num_groups_dropped_all_correct"] += stats.num_dropped_all_correct
    counts["train/num_groups_dropped_all_wrong"] += stats.num_dropped_all_wrong


def _collect_rounds(
    sampler: PromptSampler, step: int, *, rollout: RolloutController, rewards: RewardPool, tokenizer: Tokenizer,
    settings: CollectSettings,
) -> tuple[list[Group], list[Group], dict[str, float]]:
    """Rounds of `gen_batch_size` prompts until the buffer is full: (batch, everything generated, counts)."""
    buffer = DynamicSamplingBuffer(settings.train_batch_size, settings.max_num_gen_batches)
    generated: list[Group] = []
    counts = _new_counts()
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
        _count_dropped(counts, stats)
        if buffer.is_full:
            batch = buffer.take()
            break
    counts["train/num_gen_batches"] = float(num_rounds)
    return batch, generated, counts


_PRIOR_GROUPS = 4.0


def _collect_streaming(
    sampler: PromptSampler, step: int, *, rollout: RolloutController, rewards: RewardPool, tokenizer: Tokenizer,
    settings: CollectSettings, state: CollectState,
) -> tuple[list[Group], list[Group], int, dict[str, float]]:
    """Streaming dynamic sampling: (batch, every scored group, aborted tokens, counts).

    Groups are scored and filtered in the order they finish; the first `train_batch_size`
    kept ones are the batch. Prompts count as used when an engine takes them, so the
    sampler advances by exactly the prompts taken (the same number on every run of a seeded
    single-engine run, which is what resume reproduces).
    """
    start = time.perf_counter()
    records: list[PromptRecord] = []

    def prompts() -> Iterator[list[int]]:
        while True:
            records.append(sampler.next_batch(1)[0])
            yield records[-1].prompt_ids

    counts = _new_counts()
    kept: list[Group] = []
    generated: list[Group] = []
    filled_at: list[float] = []

    def worth_taking(num_taken: int) -> bool:
        # Take a prompt while the groups in flight, kept at the step's rate so far (with the last
        # step's rate as a prior worth 4 groups), are not expected to fill the batch even one
        # standard deviation short of their mean; at most gen_batch_size in flight. Counts only,
        # never time: the schedule of a seeded single-engine run is reproducible.
        in_flight = num_taken - len(generated)
        rate = (len(kept) + _PRIOR_GROUPS * state.keep_rate) / (len(generated) + _PRIOR_GROUPS)
        expected = len(kept) + rate * in_flight - math.sqrt(in_flight * rate * (1 - rate))
        return in_flight < settings.gen_batch_size and expected < settings.train_batch_size

    budget = settings.max_num_gen_batches * settings.gen_batch_size or None
    feed = PromptFeed(prompts(), limit=budget, gate=worth_taking)

    def on_group(results: list[GenerationResult]) -> None:
        if len(kept) >= settings.train_batch_size:  # another engine's group, finished after the batch filled
            counts["train/num_generated_tokens"] += sum(len(r.output_ids) for r in results)
            return
        group = Group(prompt=records[results[0].prompt_index],
                      samples=[_sample(records[r.prompt_index], r) for r in results])
        scored_at = time.perf_counter()
        stats = score_groups([group], rewards=rewards, tokenizer=tokenizer)
        counts["timing_s/reward"] += time.perf_counter() - scored_at
        counts["reward/num_errors"] += stats.num_errors
        counts["reward/num_timeouts"] += stats.num_timeouts
        apply_overlong_penalty([group], settings)
        generated.append(group)
        values = torch.tensor(group.metric(settings.filter_metric), dtype=torch.float64)
        kept_ids, filter_stats = filter_groups(values, torch.zeros(len(values), dtype=torch.long))
        _count_dropped(counts, filter_stats)
        if kept_ids.numel():
            kept.append(group)
        if len(kept) == settings.train_batch_size:
            filled_at.append(time.perf_counter())
            feed.close()
            rollout.abort()
        else:
            feed.notify()

    params = replace(settings.sampling, seed=round_seed(settings.sampling.seed, step, 0))
    per_engine = -(-settings.gen_batch_size // len(rollout.engines))
    aborted = rollout.stream(feed, params, on_group, max_inflight=per_engine)
    counts["timing_s/gen"] = time.perf_counter() - start
    if len(kept) < settings.train_batch_size:
        raise DynamicSamplingError(
            f"dynamic sampling kept {len(kept)} of the {settings.train_batch_size} groups a training batch needs "
            f"from {feed.num_taken} prompts (algorithm.filter_groups.max_num_gen_batches="
            f"{settings.max_num_gen_batches} x data.gen_batch_size={settings.gen_batch_size}); "
            f"{counts['train/num_groups_dropped_all_correct']:.0f} groups were all-correct and "
            f"{counts['train/num_groups_dropped_all_wrong']:.0f} all-wrong. Fix: raise "
            "algorithm.filter_groups.max_num_gen_batches (0 = unlimited) or data.gen_batch_size, or check the "
            "reward and the task difficulty (mostly all-correct: too easy; mostly all-wrong: too hard or the "
            "reward never matches)")
    counts["timing_s/fill"] = filled_at[0] - start
    # Clamped away from 0 and 1 so that one extreme step does not stall or flood the next.
    state.keep_rate = min(max(len(kept) / len(generated), 0.05), 0.95)
    # Rounds' worth of prompts taken, comparable with the round-based count.
    counts["train/num_gen_batches"] = feed.num_taken / settings.gen_batch_size
    counts["train/num_prompts_taken"] = float(feed.num_taken)
    return kept, generated, sum(len(r.output_ids) for r in aborted), counts


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
