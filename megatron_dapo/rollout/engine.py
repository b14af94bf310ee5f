"""The one interface every rollout engine implements: token ids in, token ids + log-probs out.

Step 1 of the RL step (DESIGN.md) runs through this protocol, and step 7 (weight sync)
feeds it: the controller hands prompts as token ids to one or more engines, gets back for
every response its token ids (never re-tokenized text), the log-probability of each sampled
token, and why generation stopped; after every optimizer step it pushes the new weights in
HF naming, bucket by bucket, and then calls :meth:`RolloutEngine.finish_weight_update`.

Which log-probability an engine reports is part of the contract, because the actor's
importance ratio compares against it. Engines report, for each sampled token,
``log_softmax(logits / temperature)[token]`` over the FULL vocabulary, i.e. after temperature
scaling and BEFORE top-k / top-p truncation. That is the quantity the actor computes
(``actor/logprobs.py``) and the one SGLang 0.5.x returns by default (its sampler takes
``log(softmax(logits / T))`` before the top-k/top-p renormalisation, unless the server runs
with SGLANG_RETURN_ORIGINAL_LOGPROB=1, which the SGLang engine forces off). Top-k/top-p only
decide the support sampled from; with top_p < 1 a token's reported log-prob is therefore
lower than the log of the probability it was actually drawn with, exactly as in verl/slime.
Greedy decoding (temperature 0) reports ``log_softmax(logits)``, SGLang's temperature-1
convention for greedy requests.

Seeding: a seeded request draws response ``(prompt i, sample j)`` from a random stream seeded by
``response_seed(seed, i * n + j)`` (the local engine: SplitMix64, token t takes the stream's
t-th output, see sampling.counter_uniforms), where ``i`` is the GLOBAL prompt index
(``index_offset + local index``). A controller that spreads prompts over several engines
passes each engine its offset, so seeded rollouts do not depend on how prompts were spread.
The local engine is bit-reproducible this way; SGLang only when its servers run with
--enable-deterministic-inference (sglang/server.py, SGLangServerConfig.deterministic).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

_SEED_MULTIPLIER = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads nearby seeds apart
_SEED_MASK = (1 << 63) - 1


class EngineError(RuntimeError):
    """An engine failed (died, timed out, rejected a request); the message names the engine."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SamplingParams:
    """How to sample responses; the same meaning on every engine."""

    n: int = 1
    """Responses per prompt (the DAPO group size G)."""
    temperature: float = 1.0
    """Logits are divided by this before softmax; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus: sample only from the smallest prefix of tokens (by probability, after top-k)
    whose mass reaches top_p; 1 = off."""
    top_k: int = -1
    """Sample only from the k most probable tokens; -1 = off."""
    max_new_tokens: int = 128
    """Hard cap on generated tokens per response; hitting it gives finish reason "length"."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after any of these tokens (included in the output, reason "stop").
    Engines also stop on the model's own eos_token_id, as SGLang does."""
    seed: int | None = None
    """Base seed for reproducible sampling; None = fresh randomness per call."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n} must be >= 1 (responses per prompt)")
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]; use 1.0 to disable")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k={self.top_k} must be -1 (off) or >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids={self.stop_token_ids} must be token ids >= 0")

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily (temperature 0)."""
        return self.temperature == 0


@dataclass(kw_only=True, slots=True)
class GenerationResult:
    """One response to one prompt."""

    prompt_index: int
    """Global index of the prompt (index_offset + position in the engine's prompt list)."""
    sample_index: int
    """Which of the n responses to that prompt, 0..n-1."""
    output_ids: list[int]
    """Generated token ids, the stop token included when the reason is "stop"."""
    logprobs: list[float]
    """log_softmax(logits / temperature)[token] of each output token; len == len(output_ids)."""
    finish_reason: FinishReason
    """stop (a stop/eos token), length (max_new_tokens or context limit) or abort."""
    weight_versions: tuple[int, ...] = ()
    """The weight versions its tokens were sampled under, oldest first (more than one when a
    weight update landed while it was generated); () = the engine does not report them."""
    routed_experts: np.ndarray | None = None
    """[len(prompt) + len(output_ids) - 1, L, k] uint8/int16 expert ids of every token the engine
    forwarded, per MoE layer (rollout/routes.py); None = not reported (dense model, or an
    engine without routes)."""
    episode: EpisodeRecord | None = None
    """A multi-turn episode's record (tools/episode.py): which output tokens a tool inserted;
    None = every output token was sampled by the policy (one turn)."""

    def __post_init__(self) -> None:
        assert len(self.output_ids) == len(self.logprobs), (len(self.output_ids), len(self.logprobs))
        assert self.finish_reason in FINISH_REASONS, self.finish_reason
        assert self.episode is None or len(self.episode.policy_mask) == len(self.output_ids)


@dataclass(frozen=True, slots=True)
class ToolCallRecord:
    """One tool call of an episode, as the policy wrote it and as the tool answered."""

    tool: str
    argument: str
    status: str
    """ok | error | timeout | output_limit | killed | failed | malformed."""
    answer: str
    """The text inserted after the call (before tokenization and truncation)."""
    seconds: float
    isolation: str = ""
    """How the tool ran the call (tools/sandbox.ToolResult.isolation: the python tool's namespaces, or
    "limits_only"; "worker process" for a custom tool); "" for an in-process tool."""


@dataclass(frozen=True, slots=True)
class EpisodeRecord:
    """What a multi-turn episode adds to its response: the segments and the tool calls."""

    policy_mask: tuple[int, ...]
    """Per output token: 1 = sampled by the policy (its log-prob is the engine's), 0 = inserted
    by a tool (log-prob 0.0; never in the loss, the entropy or the clip fraction)."""
    turns: int
    """Policy turns (generation calls) of the episode."""
    calls: tuple[ToolCallRecord, ...] = ()
    """Every tool call in order."""
    turn_capped: bool = False
    """Stopped by tools.max_turns with a call still asked for."""

    @property
    def tool_tokens(self) -> int:
        return len(self.policy_mask) - sum(self.policy_mask)

    @property
    def tool_errors(self) -> int:
        return sum(c.status != "ok" for c in self.calls)

    @property
    def tool_seconds(self) -> float:
        return sum(c.seconds for c in self.calls)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the controller and the weight sync need from an engine (local, SGLang, ...)."""

    name: str

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, index_offset: int = 0
    ) -> list[GenerationResult]:
        """Sample ``params.n`` responses for every prompt.

        Args:
            prompts: token ids of each prompt (non-empty lists).
            params: sampling settings.
            index_offset: global index of ``prompts[0]``; used in results and seeding.

        Returns:
            ``len(prompts) * n`` results, prompt-major: ``(0, 0), (0, 1), ..., (1, 0), ...``.
        """
        ...

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of full (unsharded) tensors named as in the HF checkpoint."""
        ...

    def finish_weight_update(self, version: int | None = None) -> None:
        """Called once after the last bucket: caches built on old weights are dropped.

        Args:
            version: the new weights' version (the trainer step that made them). Engines that
                tag results with `weight_versions` use it; the servers ignore it for now.
        """
        ...

    def release_memory(self) -> None:
        """Free the engine's accelerator memory (weights, KV cache) for training."""
        ...

    def resume_memory(self) -> None:
        """Take the memory back after training; weights must then be synced again."""
        ...

    def abort(self) -> None:
        """Stop in-flight generation; pending responses finish with reason "abort".

        Engines that take one request per prompt (servers) also stop every request made
        after it, until clear_abort(): a server's own abort reaches only what it is running.
        """
        ...

    def clear_abort(self) -> None:
        """A generation session starts: requests made from now on run (the controller calls it)."""
        ...

    def health(self) -> bool:
        """Whether the engine answers and can generate."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and release everything it holds."""
        ...


@runtime_checkable
class RestartableEngine(Protocol):
    """An engine whose process the controller can replace (RolloutController, max_restarts).

    `restart()` stops what is left of the old process or server (kill, never wait on a hung
    one) and starts a fresh one from the engine's HF checkpoint, under the same name and log
    path; it returns once the new one answers. The controller then loads the current weights
    into it (the buckets of the last sync, which it keeps) and sends the lost requests again.
    The local engine's process, the vLLM server and an SGLang server the controller launched
    and feeds implement it. An engine may also say ``restartable = False`` (see
    :func:`can_restart`): an SGLang client of a server that another rank owns cannot be
    replaced from the controller unless that rank serves restarts (rollout/sglang/restarts.py:
    the owner relaunches it and loads the weights it keeps).
    """

    name: str
    log_path: str | None
    """Where the engine's own process writes its log (None = it has none of its own)."""

    def restart(self) -> None:
        """Replace the engine's process or server by a fresh one (weights: its HF checkpoint)."""
        ...


def can_restart(engine: RolloutEngine) -> bool:
    """Whether the controller may replace `engine`: a RestartableEngine whose ``restartable`` is
    true (engines without that attribute always are)."""
    return isinstance(engine, RestartableEngine) and bool(getattr(engine, "restartable", True))


class EngineRestartsExhausted(EngineError):
    """An engine failed more often than rollout.max_engine_restarts allows; one line names it and its log."""


def response_seed(seed: int, response_index: int) -> int:
    """The seed of one response's generator, decorrelated from neighbouring seeds.

    Args:
        seed: the request's base seed (SamplingParams.seed).
        response_index: global response index, ``prompt_index * n + sample_index``.

    Returns:
        A non-negative 63-bit seed.
    """
    return (seed * _SEED_MULTIPLIER + response_index * 0xBF58476D1CE4E5B9 + 1) & _SEED_MASK


def check_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int | None, engine: str) -> None:
    """Reject prompts an engine cannot run, naming the engine, the prompt and the fix.

    Args:
        prompts: token ids per prompt.
        vocab_size: ids must be below this; None skips the range check.
        engine: engine name for the message.
    """
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"engine {engine}: prompt {i} is empty; every prompt needs at least one token")
        if vocab_size is not None:
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"engine {engine}: prompt {i} has token ids {bad[:5]} outside [0, {vocab_size}); "
                    "the tokenizer and the rollout model disagree on the vocabulary"
                )
