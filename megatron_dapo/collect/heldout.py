"""Held-out scoring during training: avg@n, pass@n on validation prompts, no filtering, no shaping.

The trainer's `val/*` metrics and the warm start's band checks both come from here with
the same sampling (`val_sampling_params`), so a run's first val/acc equals the warm
start's last check of the same weights. (`megatron-dapo eval`, evaluate.py, is the
separate command that scores any checkpoint.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_dapo.collect.scoring import generate_and_score
from megatron_dapo.config import ValKwargsConfig
from megatron_dapo.data.datasets import PromptRecord
from megatron_dapo.data.tokenizer import Tokenizer
from megatron_dapo.rewards.pool import RewardPool
from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.tools.episode import EpisodeRunner, episode_metrics


def val_sampling_params(val_kwargs: ValKwargsConfig, *, max_new_tokens: int, eos_id: int, seed: int) -> SamplingParams:
    """The held-out evaluation's sampling (rollout.val_kwargs), seeded trainer.seed + 1.

    The trainer's validation and the warm start's accuracy checks both use it, so the first
    val/acc of a run equals the warm start's last check of the same weights.
    """
    return SamplingParams(n=val_kwargs.n, temperature=val_kwargs.temperature, top_p=val_kwargs.top_p,
                          top_k=val_kwargs.top_k, max_new_tokens=max_new_tokens, stop_token_ids=(eos_id,),
                          seed=seed + 1)


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
        and with tools val/tools/* (tools/episode.episode_metrics).
    """
    groups, _ = generate_and_score(prompts, rollout=rollout, rewards=rewards, tokenizer=tokenizer, params=params,
                                   episodes=episodes)
    samples = [s for g in groups for s in g.samples]
    return {
        **{f"val/{k}": v for k, v in episode_metrics([s.episode for s in samples]).items()},
        "val/acc": sum(s.acc for s in samples) / len(samples),
        "val/score/mean": sum(s.score for s in samples) / len(samples),
        f"val/pass@{params.n}": sum(any(s.acc for s in g.samples) for g in groups) / len(groups),
        "val/response_length/mean": sum(len(s.response_ids) for s in samples) / len(samples),
    }
