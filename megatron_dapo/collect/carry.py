"""What collection carries from one step to the next: the keep rate and partial rollouts.

With `rollout.partial_rollout` the groups a full batch's abort left incomplete (responses
cut short with their tokens and per-token engine log-probs, their finished mates, prompts
never started) are kept as `CarriedGroup`s and continued first in the next step under the
new weights (multi-turn episodes with their segments and calls). `CollectState` holds them
and the last step's keep rate (the streaming gate's prior), and round-trips through the
checkpoint's trainer state, prompts as sampler positions. A response may span at most
`rollout.partial_rollout_max_versions` versions.

Version records. Engines know only the versions of the tokens they sampled in this step, so
a carried response keeps its own: `carry_incomplete` stores in each carried result's
`weight_versions` the versions of all its tokens so far, oldest first, and `spanned_versions`
merges them with the continuation's. In the asynchronous loop (trainer.max_staleness > 0)
the staleness bound applies to a response's oldest token: a carried group with a token older
than the step allows is dropped before it is continued (`within_version_bound`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from megatron_dapo.data.datasets import PromptRecord, PromptSampler
from megatron_dapo.rollout.engine import EpisodeRecord, GenerationResult, ToolCallRecord
from megatron_dapo.rollout.routes import routes_from_bytes, routes_to_bytes


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
                            "results": [[r.sample_index, r.output_ids, r.logprobs, r.finish_reason,
                                         None if r.routed_experts is None else routes_to_bytes(r.routed_experts),
                                         _episode_state(r.episode), list(r.weight_versions)]
                                        for r in c.results]})
        return {"keep_rate": self.keep_rate, "carried": carried}

    def load_state_dict(self, state: dict[str, Any], sampler: PromptSampler | None) -> None:
        """Restore what state_dict returned."""
        self.keep_rate = float(state["keep_rate"])
        self.carried = []
        for c in state.get("carried", []):
            assert sampler is not None, "carried groups need the controller's sampler"
            results = [GenerationResult(prompt_index=0, sample_index=int(j), output_ids=list(ids),
                                        logprobs=[float(x) for x in lps], finish_reason=why,
                                        routed_experts=None if not more or more[0] is None
                                        else routes_from_bytes(more[0]),
                                        episode=_episode_from_state(more[1] if len(more) > 1 else None),
                                        weight_versions=tuple(int(v) for v in more[2]) if len(more) > 2 else ())
                       for j, ids, lps, why, *more in c["results"]]
            self.carried.append(CarriedGroup(record=sampler.record_at(int(c["position"])), results=results,
                                             versions=[int(v) for v in c["versions"]]))


def _episode_state(e: EpisodeRecord | None) -> dict[str, Any] | None:
    """A carried episode's record for the checkpoint (its tokens are saved beside it)."""
    if e is None:
        return None
    return {"policy_mask": list(e.policy_mask), "turns": e.turns, "turn_capped": e.turn_capped,
            "calls": [[c.tool, c.argument, c.status, c.answer, c.seconds] for c in e.calls]}


def _episode_from_state(state: dict[str, Any] | None) -> EpisodeRecord | None:
    if state is None:
        return None
    return EpisodeRecord(policy_mask=tuple(int(m) for m in state["policy_mask"]), turns=int(state["turns"]),
                         turn_capped=bool(state["turn_capped"]),
                         calls=tuple(ToolCallRecord(tool=t, argument=a, status=st, answer=ans, seconds=float(sec))
                                     for t, a, st, ans, sec in state["calls"]))


def new_tokens(carried: CarriedGroup | None, result: GenerationResult) -> int:
    """Tokens of `result` generated in this step (a carried prefix was counted when it was made)."""
    before = 0 if carried is None else len(carried.results[result.sample_index].output_ids)
    return len(result.output_ids) - before


def versions_spanned(carried: CarriedGroup | None, result: GenerationResult) -> int:
    """Weight versions `result`'s tokens span: the carried count, plus this step's if it added tokens."""
    before = 0 if carried is None else carried.versions[result.sample_index]
    return before + (1 if new_tokens(carried, result) > 0 else 0)


def spanned_versions(carried: CarriedGroup | None, result: GenerationResult) -> tuple[int, ...]:
    """The versions all of `result`'s tokens were sampled under, oldest first: a carried prefix's
    record, then this step's (an episode's result already holds its prefix's: tools/episode.py)."""
    before = () if carried is None else carried.results[result.sample_index].weight_versions
    now = result.weight_versions if carried is None or new_tokens(carried, result) > 0 else ()
    return tuple(dict.fromkeys((*before, *now)))


def carry_incomplete(incomplete: list[GenerationResult], records: list[PromptRecord],
           carried_in: dict[int, CarriedGroup], n: int) -> list[CarriedGroup]:
    """The incomplete groups as CarriedGroups, in feed order."""
    by_index: dict[int, list[GenerationResult]] = {}
    for r in incomplete:
        by_index.setdefault(r.prompt_index, []).append(r)
    carry = []
    for index in sorted(by_index):
        results = sorted(by_index[index], key=lambda r: r.sample_index)
        results = [replace(r, weight_versions=spanned_versions(carried_in.get(index), r)) for r in results]
        assert [r.sample_index for r in results] == list(range(n)), "an engine returned a partial group"
        carry.append(CarriedGroup(record=records[index], results=results,
                                  versions=[versions_spanned(carried_in.get(index), r) for r in results]))
    return carry


def within_version_bound(carried: list[CarriedGroup], max_versions: int, oldest_allowed: int | None = None
                         ) -> tuple[list[CarriedGroup], list[CarriedGroup], int]:
    """Split carried groups into (continue, drop, of them dropped for staleness).

    Continuing a response adds this step's version, so one at `max_versions` is dropped;
    with `oldest_allowed` (the asynchronous loop's bound for this step) so is a group with any
    token, in a response to continue or a finished mate, sampled under an older version.
    """
    keep, drop, stale = [], [], 0
    for c in carried:
        over = any(r.finish_reason == "abort" and v + 1 > max_versions for r, v in zip(c.results, c.versions))
        old = oldest_allowed is not None and any(r.weight_versions and r.weight_versions[0] < oldest_allowed
                                                 for r in c.results)
        stale += old and not over
        (drop if over or old else keep).append(c)
    return keep, drop, stale
