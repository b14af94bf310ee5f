"""Held-out scoring during training: avg@n, pass@n on validation prompts, no filtering, no shaping.

The trainer's `val/*` metrics and the warm start's band checks both come from here with the
same sampling settings (`val_sampling_params`) but draws of their own: the band checks are
seeded trainer.seed + 1, the trainer's validation trainer.seed + 2. The warm start stops at
the first check inside its band, so the check it stops on is selected for a high draw: reused
as the run's step-0 val/acc it could overstate the starting accuracy and so understate the gain
(2026-11-29: seed 21's stopping check read 0.316, ten fresh draws of the same weights
0.264-0.309, mean 0.287; docs/benchmarks.md). (`megatron-dapo eval`, evaluate.py, is the
separate command that scores any checkpoint; its default seed is the validation's.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_dapo.collect.scoring import generate_and_score
from megatron_dapo.collect.types import Group
from megatron_dapo.config import ValKwargsConfig
from megatron_dapo.data.datasets import PromptRecord
from megatron_dapo.data.tokenizer import Tokenizer
from megatron_dapo.rewards.pool import RewardPool
from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.tools.episode import EpisodeRunner, episode_metrics
from megatron_dapo.tools.outcomes import call_outcome_metrics

VAL_SEED_OFFSET = 2
"""The trainer's validation (and `megatron-dapo eval` by default) samples with trainer.seed + 2."""
BAND_CHECK_SEED_OFFSET = 1
"""The warm start's band checks sample with trainer.seed + 1: a draw the run's evaluations never
reuse (module docstring). Kept at 1 so that cached warm starts stay valid."""


def val_sampling_params(val_kwargs: ValKwargsConfig, *, max_new_tokens: int, eos_id: int, seed: int,
                        offset: int = VAL_SEED_OFFSET) -> SamplingParams:
    """The held-out evaluation's sampling (rollout.val_kwargs), seeded trainer.seed + ``offset``.

    Args:
        seed: trainer.seed.
        offset: VAL_SEED_OFFSET for the trainer's validation, BAND_CHECK_SEED_OFFSET for the warm
            start's checks (the same sampling, an independent draw).
    """
    return SamplingParams(n=val_kwargs.n, temperature=val_kwargs.temperature, top_p=val_kwargs.top_p,
                          top_k=val_kwargs.top_k, max_new_tokens=max_new_tokens, stop_token_ids=(eos_id,),
                          seed=seed + offset)


def score_heldout(
    prompts: Sequence[PromptRecord],
    *,
    rollout: RolloutController,
    rewards: RewardPool,
    tokenizer: Tokenizer,
    params: SamplingParams,
    episodes: EpisodeRunner | None = None,
) -> dict[str, Any]:
    """avg@n accuracy and score on held-out prompts (no filtering, no shaping), as episodes with
    the run's tools when it has them.

    Returns:
        val/acc (avg@n, the paper's metric), val/score/mean, val/pass@n, val/response_length/mean,
        val/acc/<kind> for prompts whose extra_info names their kind (the embedded task's add,
        sub, big_mul, ...: `accuracy_by_kind`), and with tools val/tools/* (tools/episode.episode_metrics;
        val/tools/acc_called and acc_not_called, tools/outcomes.py).
    """
    groups, _ = generate_and_score(prompts, rollout=rollout, rewards=rewards, tokenizer=tokenizer, params=params,
                                   episodes=episodes)
    samples = [s for g in groups for s in g.samples]
    return {
        **{f"val/{k}": v for k, v in episode_metrics([s.episode for s in samples]).items()},
        **{f"val/{k}": v for k, v in call_outcome_metrics(groups, ()).items() if k.startswith("tools/acc_")},
        "val/acc": sum(s.acc for s in samples) / len(samples),
        "val/score/mean": sum(s.score for s in samples) / len(samples),
        f"val/pass@{params.n}": sum(any(s.acc for s in g.samples) for g in groups) / len(groups),
        "val/response_length/mean": sum(len(s.response_ids) for s in samples) / len(samples),
        **{f"val/acc/{kind}": acc for kind, acc in accuracy_by_kind(groups).items()},
    }


def accuracy_by_kind(groups: Sequence[Group]) -> dict[str, float]:
    """avg@n accuracy per problem kind (a prompt's extra_info["kind"]); prompts without one are left out."""
    by: dict[str, list[float]] = {}
    for g in groups:
        kind = g.prompt.extra_info.get("kind") if isinstance(g.prompt.extra_info, dict) else None
        if isinstance(kind, str):
            by.setdefault(kind, []).extend(float(s.acc) for s in g.samples)
    return {kind: sum(accs) / len(accs) for kind, accs in sorted(by.items()) if accs}
