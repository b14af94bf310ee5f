"""One step's training batch (DESIGN.md steps 1-4), round-based or streaming, with partial rollouts.

`collect_batch` is what the trainer calls on the controller. Without dynamic sampling one
round of `train_batch_size` prompts is the batch; with it, either verl's rounds
(collect.collect_rounds) or streaming (here): the engines take prompts from a gated
`PromptFeed`, each group is scored, shaped and filtered the moment its n responses are
done, and when `train_batch_size` groups are kept the feed closes and every engine is
aborted. With `rollout.partial_rollout` the groups the abort left incomplete are carried
(`CollectState.carried`, saved in checkpoints) and continued first in the next step, under
the new weights; every token keeps the engine log-prob it was sampled with.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from megatron_dapo.algo.dynamic_sampling import EXHAUSTED_FIX, DynamicSamplingError, filter_groups
from megatron_dapo.collect import (
    CollectSettings,
    Group,
    apply_overlong_penalty,
    assign_advantages,
    batch_metrics,
    collect_rounds,
    count_dropped,
    make_sample,
    new_counts,
    round_seed,
    score_groups,
)
from megatron_dapo.data.datasets import PromptRecord, PromptSampler
from megatron_dapo.data.tokenizer import Tokenizer
from megatron_dapo.rewards.pool import RewardPool
from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import GenerationResult
from megatron_dapo.rollout.streaming import CarriedPrompt, PromptFeed

__all__ = ["CarriedGroup", "CollectState", "collect_batch"]

_PRIOR_GROUPS = 4.0
"""Weight of the last step's keep rate, in groups, in the in-flight gate's estimate."""


@dataclass(kw_only=True, slots=True)
class CarriedGroup:
    """A group the batch's abort left incomplete, continued in a later step (partial rollout)."""

    record: PromptRecord
    """The prompt."""
    results: list[GenerationResult]
    """Its n responses in sample order: reason abort = to continue from its tokens, else final."""
    versions: list[int]
    """Weight versions each response's tokens were sampled under so far (0 = no token yet)."""


@dataclass(kw_only=True, slots=True)
class CollectState:
    """What collection carries from one step to the next (saved in checkpoints)."""

    keep_rate: float = 0.5
    """Share of the last step's finished groups that dynamic sampling kept: the prior of how many
    prompts the next step puts in flight."""
    carried: list[CarriedGroup] = field(default_factory=list)
    """Partial rollouts to continue first in the next step."""

    def state_dict(self, sampler: PromptSampler | None) -> dict[str, Any]:
        """For the checkpoint's trainer state; prompts are saved as their sampler positions."""
        carried = []
        for c in self.carried:
            assert sampler is not None, "carried groups come from the controller's sampler"
            carried.append({"position": sampler.position_of(c.record), "versions": list(c.versions),
                            "results": [[r.sample_index, r.output_ids, r.logprobs, r.finish_reason]
                                        for r in c.results]})
        return {"keep_rate": self.keep_rate, "carried": carried}

    def load_state_dict(self, state: dict[str, Any], sampler: PromptSampler | None) -> None:
        """Restore what state_dict returned."""
        self.keep_rate = float(state["keep_rate"])
        self.carried = []
        for c in state.get("carried", []):
            assert sampler is not None, "carried groups need the controller's sampler"
            results = [GenerationResult(prompt_index=0, sample_index=int(j), output_ids=list(ids),
                                        logprobs=[float(x) for x in lps], finish_reason=why)
                       for j, ids, lps, why in c["results"]]
            self.carried.append(CarriedGroup(record=sampler.record_at(int(c["position"])), results=results,
                                             versions=[int(v) for v in c["versions"]]))


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
        batch, generated, counts = _collect_streaming(
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


def _collect_streaming(
    sampler: PromptSampler, step: int, *, rollout: RolloutController, rewards: RewardPool, tokenizer: Tokenizer,
    settings: CollectSettings, state: CollectState,
) -> tuple[list[Group], list[Group], dict[str, float]]:
    """Streaming dynamic sampling: (batch, every scored group, counts).

    Groups are scored and filtered in the order they finish; the first `train_batch_size`
    kept ones are the batch. Prompts count as used when an engine takes them, so the
    sampler advances by exactly the prompts taken (the same number on every run of a seeded
    single-engine run, which is what resume reproduces).
    """
    start = time.perf_counter()
    counts = new_counts()
    records: list[PromptRecord] = []
    carried_in: dict[int, CarriedGroup] = {}  # feed index -> the carried group it continues
    to_continue, dropped = _within_version_bound(state.carried, settings.partial_max_versions)
    state.carried = []
    counts["rollout/partial_dropped_groups"] = float(len(dropped))

    def prompts() -> Iterator[Sequence[int] | CarriedPrompt]:
        for c in to_continue:  # partial rollouts first, then new prompts
            carried_in[len(records)] = c
            records.append(c.record)
            yield CarriedPrompt(prompt=c.record.prompt_ids, results=tuple(c.results))
        while True:
            records.append(sampler.next_batch(1)[0])
            yield records[-1].prompt_ids

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
        index = results[0].prompt_index
        counts["train/num_generated_tokens"] += sum(_new_tokens(carried_in.get(index), r) for r in results)
        if len(kept) >= settings.train_batch_size:  # another engine's group, finished after the batch filled
            return
        group = Group(prompt=records[index], samples=[make_sample(records[index], r) for r in results])
        for sample, r in zip(group.samples, results):
            sample.num_versions = _versions(carried_in.get(index), r)
        scored_at = time.perf_counter()
        stats = score_groups([group], rewards=rewards, tokenizer=tokenizer)
        counts["timing_s/reward"] += time.perf_counter() - scored_at
        counts["reward/num_errors"] += stats.num_errors
        counts["reward/num_timeouts"] += stats.num_timeouts
        apply_overlong_penalty([group], settings)
        generated.append(group)
        values = torch.tensor(group.metric(settings.filter_metric), dtype=torch.float64)
        kept_ids, filter_stats = filter_groups(values, torch.zeros(len(values), dtype=torch.long))
        count_dropped(counts, filter_stats)
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
    incomplete = rollout.stream(feed, params, on_group, max_inflight=per_engine)
    counts["timing_s/gen"] = time.perf_counter() - start
    if len(kept) < settings.train_batch_size:
        raise DynamicSamplingError(
            f"dynamic sampling kept {len(kept)} of the {settings.train_batch_size} groups a training batch needs "
            f"from {feed.num_taken} prompts (algorithm.filter_groups.max_num_gen_batches="
            f"{settings.max_num_gen_batches} x data.gen_batch_size={settings.gen_batch_size}); "
            f"{counts['train/num_groups_dropped_all_correct']:.0f} groups were all-correct and "
            f"{counts['train/num_groups_dropped_all_wrong']:.0f} all-wrong. {EXHAUSTED_FIX}")
    new_tokens = sum(_new_tokens(carried_in.get(r.prompt_index), r) for r in incomplete)
    counts["train/num_generated_tokens"] += new_tokens
    carry = _carry(incomplete, records, carried_in, settings.n) if settings.partial_rollout else []
    state.carried = carry
    # Tokens thrown away: generated this step in incomplete groups and not carried, plus the
    # carried groups dropped at the version bound (generated in earlier steps).
    counts["rollout/aborted_tokens"] = (0.0 if settings.partial_rollout else float(new_tokens)) + sum(
        len(r.output_ids) for c in dropped for r in c.results)
    counts["rollout/carried_groups"] = float(len(carry))
    counts["rollout/carried_tokens"] = float(sum(len(r.output_ids) for c in carry for r in c.results))
    counts["rollout/max_versions_per_response"] = float(max(s.num_versions for g in kept for s in g.samples))
    counts["timing_s/fill"] = filled_at[0] - start
    # Clamped away from 0 and 1 so that one extreme step does not stall or flood the next.
    state.keep_rate = min(max(len(kept) / len(generated), 0.05), 0.95)
    # Rounds' worth of prompts taken, comparable with the round-based count.
    counts["train/num_gen_batches"] = feed.num_taken / settings.gen_batch_size
    counts["train/num_prompts_taken"] = float(feed.num_taken)
    return kept, generated, counts


def _new_tokens(carried: CarriedGroup | None, result: GenerationResult) -> int:
    """Tokens of `result` generated in this step (a carried prefix was counted when it was made)."""
    before = 0 if carried is None else len(carried.results[result.sample_index].output_ids)
    return len(result.output_ids) - before


def _versions(carried: CarriedGroup | None, result: GenerationResult) -> int:
    """Weight versions `result`'s tokens span: the carried count, plus this step's if it added tokens."""
    before = 0 if carried is None else carried.versions[result.sample_index]
    return before + (1 if _new_tokens(carried, result) > 0 else 0)


def _carry(incomplete: list[GenerationResult], records: list[PromptRecord],
           carried_in: dict[int, CarriedGroup], n: int) -> list[CarriedGroup]:
    """The incomplete groups as CarriedGroups, in feed order."""
    by_index: dict[int, list[GenerationResult]] = {}
    for r in incomplete:
        by_index.setdefault(r.prompt_index, []).append(r)
    carry = []
    for index in sorted(by_index):
        results = sorted(by_index[index], key=lambda r: r.sample_index)
        assert [r.sample_index for r in results] == list(range(n)), "an engine returned a partial group"
        carry.append(CarriedGroup(record=records[index], results=results,
                                  versions=[_versions(carried_in.get(index), r) for r in results]))
    return carry


def _within_version_bound(carried: list[CarriedGroup], max_versions: int) -> tuple[list[CarriedGroup], list[CarriedGroup]]:
    """Split carried groups into (continue, drop): continuing a response adds this step's version."""
    keep, drop = [], []
    for c in carried:
        over = any(r.finish_reason == "abort" and v + 1 > max_versions for r, v in zip(c.results, c.versions))
        (drop if over else keep).append(c)
    return keep, drop
