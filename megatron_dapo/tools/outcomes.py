"""Whether calling pays, per step: the tool metrics that say where the reward for a call goes.

`tools/call_rate` (episode.py) says how often the policy calls; it does not say whether a call
is rewarded, nor whether dynamic sampling keeps the groups in which calling decides the reward.
From a step's generated groups (dropped ones included) and the kept batch:

- ``tools/acc_called`` / ``tools/acc_not_called``: the verifier's accuracy of episodes with at
  least one call and of those without (absent when there are none of the kind);
- ``tools/mixed_call_groups``: the share of generated groups in which some episodes call and
  some do not, the only groups where the advantage can credit the choice to call;
- ``tools/mixed_call_groups_kept``: the share of those that dynamic sampling kept (a mixed group
  whose episodes all score the same is dropped, and its choice is never credited);
- ``tools/call_rate_kept``: the call rate over the kept groups' episodes, what the update sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["call_outcome_metrics"]


def _called(sample: Any) -> bool:
    return sample.episode is not None and bool(sample.episode.calls)


def call_outcome_metrics(generated: Sequence[Any], kept: Sequence[Any]) -> dict[str, float]:
    """The metrics above over `generated` (every group of the step) and `kept` (its batch); {} without episodes."""
    samples = [s for g in generated for s in g.samples]
    if not any(s.episode is not None for s in samples):
        return {}
    out: dict[str, float] = {}
    for name, want in (("tools/acc_called", True), ("tools/acc_not_called", False)):
        those = [s for s in samples if _called(s) == want]
        if those:
            out[name] = sum(s.acc for s in those) / len(those)
    kept_ids = {id(g) for g in kept}
    mixed = [g for g in generated if len({_called(s) for s in g.samples}) == 2]
    out["tools/mixed_call_groups"] = len(mixed) / len(generated)
    if mixed:
        out["tools/mixed_call_groups_kept"] = sum(id(g) in kept_ids for g in mixed) / len(mixed)
    kept_samples = [s for g in kept for s in g.samples]
    if kept_samples:
        out["tools/call_rate_kept"] = sum(_called(s) for s in kept_samples) / len(kept_samples)
    return out
