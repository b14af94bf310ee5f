"""Dynamic sampling (DAPO section 3.2): keep only groups that carry a learning signal.

A group whose responses all score the same (all correct or all wrong) has zero
advantage everywhere, so it adds no gradient and only dilutes the token-mean. The
controller (steps 1-3) therefore over-samples: it generates a round of groups, keeps
those whose metric has a non-zero spread, and repeats until it holds the number of
groups a training batch needs; the surplus of the last round is trimmed.
`DynamicSamplingBuffer` is that loop's state. It gives up with `DynamicSamplingError`
after `max_num_gen_batches` rounds, because a task that is far too easy or too hard
(or a broken reward) would otherwise generate forever.

A constant group is reported by its value: all-correct at or above `correct_at`
(acc 1, score +1), all-wrong at or below `wrong_at` (acc 0, score -1), otherwise
"other" (for example a shaped score that happens to be equal across the group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

_STATE_VERSION = 1

EXHAUSTED_FIX = (
    "Fix: raise algorithm.filter_groups.max_num_gen_batches (0 = unlimited) or data.gen_batch_size, or check "
    "the reward and the task difficulty (mostly all-correct: too easy; mostly all-wrong: too hard or the "
    "reward never matches)"
)
"""The fix named when dynamic sampling cannot fill a batch (rounds or streaming)."""


class DynamicSamplingError(RuntimeError):
    """Too few groups with reward spread after the allowed number of generation rounds."""


@dataclass(kw_only=True, slots=True)
class GroupFilterStats:
    """How the groups of one batch were split by `filter_groups`."""

    num_groups: int
    """Groups seen."""
    num_kept: int
    """Groups whose metric has a non-zero spread."""
    num_dropped_all_correct: int
    """Constant groups at or above `correct_at`."""
    num_dropped_all_wrong: int
    """Constant groups at or below `wrong_at`."""
    num_dropped_other: int
    """Constant groups at a value in between."""


@dataclass(kw_only=True, slots=True)
class RoundStats(GroupFilterStats):
    """`GroupFilterStats` of one generation round, plus where the buffer stands after it."""

    round_index: int
    """1 for the first round since the buffer was last emptied."""
    num_buffered: int
    """Kept groups held after this round (may exceed the target; `take` trims)."""


def filter_groups(
    metric_values: torch.Tensor,
    group_index: torch.Tensor,
    correct_at: float = 1.0,
    wrong_at: float = 0.0,
) -> tuple[torch.Tensor, GroupFilterStats]:
    """Find the groups whose metric is not the same for all their responses.

    Args:
        metric_values: [N] per-response metric (algorithm.filter_groups.metric: acc, score).
        group_index: [N] integer prompt id of each response; any ids, any order.
        correct_at: a constant group at or above this value counts as all-correct.
        wrong_at: a constant group at or below this value counts as all-wrong.

    Returns:
        (kept_ids, stats): kept_ids is a 1-D tensor of the kept group ids in ascending order;
        a group of one is constant and therefore dropped.
    """
    if metric_values.dim() != 1 or metric_values.shape != group_index.shape:
        raise ValueError(
            f"metric_values {tuple(metric_values.shape)} and group_index {tuple(group_index.shape)} "
            "must be 1-D of the same length: one value and one prompt id per response"
        )
    if metric_values.numel() == 0:
        empty = GroupFilterStats(
            num_groups=0, num_kept=0, num_dropped_all_correct=0, num_dropped_all_wrong=0, num_dropped_other=0
        )
        return group_index.new_empty(0), empty
    values = metric_values.detach().to(torch.float64)
    group_ids, inverse = torch.unique(group_index, return_inverse=True)  # inverse: [N] -> [0, G)
    num_groups = group_ids.numel()
    lowest = torch.full((num_groups,), float("inf"), dtype=torch.float64, device=values.device)
    highest = torch.full_like(lowest, float("-inf"))
    lowest = lowest.scatter_reduce(0, inverse, values, reduce="amin")
    highest = highest.scatter_reduce(0, inverse, values, reduce="amax")
    # max > min is std > 0 without the rounding of a computed std.
    keep = highest > lowest
    constant = ~keep
    all_correct = constant & (lowest >= correct_at)
    all_wrong = constant & (lowest <= wrong_at)
    stats = GroupFilterStats(
        num_groups=num_groups,
        num_kept=int(keep.sum()),
        num_dropped_all_correct=int(all_correct.sum()),
        num_dropped_all_wrong=int(all_wrong.sum()),
        num_dropped_other=int((constant & ~all_correct & ~all_wrong).sum()),
    )
    return group_ids[keep], stats


class DynamicSamplingBuffer:
    """Accumulates kept groups over generation rounds until a training batch is full.

    Usage per RL step: call `add_round` after scoring each generated round until
    `is_full`, then `take`. Groups are opaque payloads (the controller's per-prompt
    records); only their per-response metric values are read.
    """

    def __init__(
        self,
        target_num_groups: int,
        max_num_gen_batches: int,
        correct_at: float = 1.0,
        wrong_at: float = 0.0,
    ) -> None:
        """Create an empty buffer.

        Args:
            target_num_groups: groups per training batch (data.train_batch_size), > 0.
            max_num_gen_batches: rounds allowed per batch before `DynamicSamplingError`
                (algorithm.filter_groups.max_num_gen_batches); 0 = unlimited.
            correct_at: a constant group at or above this counts as all-correct.
            wrong_at: a constant group at or below this counts as all-wrong.
        """
        if target_num_groups <= 0:
            raise ValueError(
                f"target_num_groups={target_num_groups} (data.train_batch_size) must be > 0 groups"
            )
        if max_num_gen_batches < 0:
            raise ValueError(
                f"algorithm.filter_groups.max_num_gen_batches={max_num_gen_batches} must be >= 0 "
                "(0 = unlimited)"
            )
        self.target_num_groups = target_num_groups
        self.max_num_gen_batches = max_num_gen_batches
        self.correct_at = correct_at
        self.wrong_at = wrong_at
        self._groups: list[Any] = []
        self._num_rounds = 0
        self._dropped = {"all_correct": 0, "all_wrong": 0, "other": 0}

    @property
    def is_full(self) -> bool:
        """True once at least `target_num_groups` groups are held."""
        return len(self._groups) >= self.target_num_groups

    @property
    def num_buffered(self) -> int:
        """Kept groups held now."""
        return len(self._groups)

    @property
    def num_rounds(self) -> int:
        """Rounds added since the buffer was last emptied."""
        return self._num_rounds

    def add_round(self, groups: Sequence[Any], metrics: Sequence[Sequence[float]]) -> RoundStats:
        """Filter one generation round and keep its groups that have a metric spread.

        Args:
            groups: G payloads, one per prompt, in generation order.
            metrics: G lists of the per-response metric values of each group.

        Returns:
            The round's `RoundStats`.

        Raises:
            DynamicSamplingError: this was round `max_num_gen_batches` (> 0) and the buffer is
                still not full. The buffer keeps its contents.
        """
        if len(groups) != len(metrics):
            raise ValueError(
                f"add_round got {len(groups)} groups but {len(metrics)} metric lists; pass one list "
                "of per-response values per group"
            )
        sizes = [len(values) for values in metrics]
        if 0 in sizes:
            raise ValueError(
                f"group {sizes.index(0)} of this round has no metric values; every group needs its "
                "responses' values (rollout.n of them)"
            )
        flat = torch.tensor([float(v) for values in metrics for v in values], dtype=torch.float64)
        group_index = torch.repeat_interleave(
            torch.arange(len(groups)), torch.tensor(sizes, dtype=torch.long)
        )
        kept_ids, stats = filter_groups(flat, group_index, self.correct_at, self.wrong_at)
        # Ascending ids are generation order: first come, first kept.
        self._groups.extend(groups[i] for i in kept_ids.tolist())
        self._num_rounds += 1
        self._dropped["all_correct"] += stats.num_dropped_all_correct
        self._dropped["all_wrong"] += stats.num_dropped_all_wrong
        self._dropped["other"] += stats.num_dropped_other
        round_stats = RoundStats(
            **asdict(stats), round_index=self._num_rounds, num_buffered=self.num_buffered
        )
        if not self.is_full and 0 < self.max_num_gen_batches <= self._num_rounds:
            raise DynamicSamplingError(self._exhausted_message())
        return round_stats

    def _exhausted_message(self) -> str:
        dropped = self._dropped
        return (
            f"dynamic sampling kept {self.num_buffered} of the {self.target_num_groups} groups a training "
            f"batch needs after {self._num_rounds} generation rounds "
            f"(algorithm.filter_groups.max_num_gen_batches={self.max_num_gen_batches}); "
            f"{sum(dropped.values())} groups were dropped for having the same metric in every response: "
            f"{dropped['all_correct']} all-correct, {dropped['all_wrong']} all-wrong, "
            f"{dropped['other']} constant at another value. {EXHAUSTED_FIX}"
        )

    def take(self) -> list[Any]:
        """Return exactly `target_num_groups` groups in the order they were kept and empty the buffer.

        The surplus beyond the target is discarded, as in DAPO; the round counter and the
        drop counts restart.

        Returns:
            The first `target_num_groups` kept payloads.
        """
        if not self.is_full:
            raise RuntimeError(
                f"take() with {self.num_buffered} of {self.target_num_groups} groups buffered; call "
                "add_round until is_full"
            )
        batch = self._groups[: self.target_num_groups]
        self._groups = []
        self._num_rounds = 0
        self._dropped = dict.fromkeys(self._dropped, 0)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The buffer's contents as plain python containers (payloads are stored as given)."""
        return {
            "version": _STATE_VERSION,
            "groups": list(self._groups),
            "num_rounds": self._num_rounds,
            "dropped": dict(self._dropped),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, for example from a checkpoint.

        Args:
            state: a dict produced by `state_dict` of a buffer with any target.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"dynamic sampling state has version {state.get('version')!r}, this code reads version "
                f"{_STATE_VERSION}; the checkpoint was written by another megatron-dapo version"
            )
        self._groups = list(state["groups"])
        self._num_rounds = int(state["num_rounds"])
        self._dropped = {key: int(state["dropped"][key]) for key in ("all_correct", "all_wrong", "other")}
