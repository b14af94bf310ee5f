"""What collection produces and the settings it runs under: `Sample`, `Group`, `CollectSettings`.

A `Sample` is one response with its engine log-probs, verifier score, overlong penalty and
advantage; a `Group` is the n responses to one prompt, the unit dynamic sampling keeps or
drops. `CollectSettings` are the controller's settings for a step, taken from the config
sections, so nothing below reads the config itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_dapo.data.datasets import PromptRecord
from megatron_dapo.rollout.engine import EpisodeRecord, SamplingParams
from megatron_dapo.tools.episode import EpisodeRunner


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
    reward_extra: dict[str, float] = field(default_factory=dict)
    """The other numbers the reward function returned (verl's extra metrics: reward_extra/*)."""
    overlong_penalty: float = 0.0
    """Soft overlong punishment added to the score (<= 0)."""
    advantage: float = 0.0
    """Group-relative advantage of the shaped reward."""
    num_versions: int = 1
    """Weight versions its tokens were sampled under (> 1 for a continued partial rollout)."""
    weight_versions: tuple[int, ...] = ()
    """Which versions, oldest first, where the engine reports them (the asynchronous loop's
    staleness is the age of the first)."""
    routed_experts: np.ndarray | None = None
    """[len(prompt) + len(response) - 1, L, k] the engine's expert ids per token and MoE layer
    (rollout/routes.py), for routing replay; None = not reported."""
    episode: EpisodeRecord | None = None
    """A multi-turn episode's segments and calls (tools/episode.py): its policy_mask keeps tool
    tokens out of the loss; None = one turn, every token the policy's."""

    @property
    def loss_mask(self) -> list[int] | None:
        """1 per response token the policy sampled, 0 per tool token; None = all the policy's."""
        return list(self.episode.policy_mask) if self.episode is not None else None

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
    max_staleness: int | None = None
    """The asynchronous loop's bound (trainer.max_staleness > 0): carried groups with a token older
    than the step allows are dropped; None in the synchronous loop."""
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
    episodes: EpisodeRunner | None = None
    """Multi-turn episodes with tool calls (tools.enable); None = one turn per response."""
