"""Streaming dynamic sampling (`algorithm.filter_groups.mode: streaming`, the default).

The engines take prompts from a gated `PromptFeed`; each group is scored, shaped and
filtered the moment its n responses are done, and when `train_batch_size` groups are kept
the feed closes and every engine is aborted. The batch is the first `train_batch_size`
kept groups in completion order. Partial rollouts (carry.py) are fed first.

With tools, each prompt's group is n multi-turn episodes driven request by request
(`_episodes_driver`, tools/episode.py); the abort ends them mid-turn or while a tool call
runs, and a partial rollout resumes each from its tokens (the pending call runs again).
Which prompts finish first then depends on tool and request timing, on every engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from megatron_dapo.algo.dynamic_sampling import (
    EXHAUSTED_FIX,
    DynamicSamplingError,
    filter_groups,
)
from megatron_dapo.collect.carry import (
    CarriedGroup,
    CollectState,
    carry_incomplete,
    new_tokens,
    spanned_versions,
    versions_spanned,
    within_version_bound,
)
from megatron_dapo.collect.rounds import round_seed
from megatron_dapo.collect.scoring import (
    apply_overlong_penalty,
    count_dropped,
    make_sample,
    new_counts,
    score_groups,
)
from megatron_dapo.collect.types import CollectSettings, Group
from megatron_dapo.data.datasets import PromptRecord, PromptSampler
from megatron_dapo.data.tokenizer import Tokenizer
from megatron_dapo.rewards.pool import RewardPool
from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import GenerationResult, SamplingParams
from megatron_dapo.rollout.streaming import CarriedPrompt, FeedItem, ItemDriver, PromptFeed, Turns
from megatron_dapo.tools.episode import EpisodeRunner

_PRIOR_GROUPS = 4.0
"""Weight of the last step's keep rate, in groups, in the in-flight gate's estimate."""


def collect_streaming(
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
    oldest_allowed = None if settings.max_staleness is None else step - 1 - settings.max_staleness
    to_continue, dropped, stale = within_version_bound(state.carried, settings.partial_max_versions, oldest_allowed)
    state.carried = []
    counts["rollout/partial_dropped_groups"] = float(len(dropped))
    counts["rollout/partial_dropped_stale_groups"] = float(stale)

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
        counts["train/num_generated_tokens"] += sum(new_tokens(carried_in.get(index), r) for r in results)
        if len(kept) >= settings.train_batch_size:  # another engine's group, finished after the batch filled
            return
        group = Group(prompt=records[index], samples=[make_sample(records[index], r) for r in results])
        for sample, r in zip(group.samples, results):
            sample.num_versions = versions_spanned(carried_in.get(index), r)
            sample.weight_versions = spanned_versions(carried_in.get(index), r)
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
    incomplete = rollout.stream(feed, params, on_group, max_inflight=per_engine,
                                drive=None if settings.episodes is None else _episodes_driver(settings.episodes))
    counts["timing_s/gen"] = time.perf_counter() - start
    if len(kept) < settings.train_batch_size:
        raise DynamicSamplingError(
            f"dynamic sampling kept {len(kept)} of the {settings.train_batch_size} groups a training batch needs "
            f"from {feed.num_taken} prompts (algorithm.filter_groups.max_num_gen_batches="
            f"{settings.max_num_gen_batches} x data.gen_batch_size={settings.gen_batch_size}); "
            f"{counts['train/num_groups_dropped_all_correct']:.0f} groups were all-correct and "
            f"{counts['train/num_groups_dropped_all_wrong']:.0f} all-wrong. {EXHAUSTED_FIX}")
    num_incomplete_tokens = sum(new_tokens(carried_in.get(r.prompt_index), r) for r in incomplete)
    counts["train/num_generated_tokens"] += num_incomplete_tokens
    carry = carry_incomplete(incomplete, records, carried_in, settings.n) if settings.partial_rollout else []
    state.carried = carry
    # Tokens thrown away: generated this step in incomplete groups and not carried, plus the
    # carried groups dropped at the version bound (generated in earlier steps).
    counts["rollout/aborted_tokens"] = (0.0 if settings.partial_rollout else float(num_incomplete_tokens)) + sum(
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


def _episodes_driver(runner: EpisodeRunner) -> ItemDriver:
    """A feed item's group as multi-turn episodes (tools/episode.py): new, or a carried group resumed."""

    def drive(turns: Turns, item: FeedItem, params: SamplingParams, aborted: Callable[[], bool]
              ) -> list[GenerationResult]:
        results = runner.generate(turns, [item.prompt], params, carried=item.carried, aborted=aborted)
        return [replace(r, prompt_index=item.index) for r in results]

    return drive
