"""tools/outcomes.py: the per-step metrics that say whether calling is rewarded and whether
dynamic sampling keeps the groups where the choice to call decides the reward (issue 63)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_dapo.rollout.engine import EpisodeRecord, ToolCallRecord
from megatron_dapo.tools.outcomes import call_outcome_metrics

CALL = ToolCallRecord(tool="calculator", argument="545*40", status="ok", answer="21800", seconds=0.0)


def _sample(called: bool, acc: bool):
    episode = EpisodeRecord(policy_mask=(1,), turns=2 if called else 1, calls=(CALL,) if called else ())
    return SimpleNamespace(episode=episode, acc=acc)


def _group(*pairs):
    return SimpleNamespace(samples=[_sample(c, a) for c, a in pairs])


def test_accuracy_by_call_mixed_groups_and_what_the_batch_keeps():
    mixed_rewarded = _group((True, True), (True, True), (False, False), (False, False))   # calling decides it
    mixed_flat = _group((True, False), (False, False), (False, False), (False, False))    # all wrong: dropped
    no_call = _group((False, True), (False, False), (False, True), (False, False))
    all_call = _group((True, True), (True, True), (True, True), (True, False))
    generated, kept = [mixed_rewarded, mixed_flat, no_call, all_call], [mixed_rewarded, no_call, all_call]
    m = call_outcome_metrics(generated, kept)
    assert m["tools/acc_called"] == pytest.approx(5 / 7)        # 7 episodes called, 5 right
    assert m["tools/acc_not_called"] == pytest.approx(2 / 9)    # 9 did not, 2 right
    assert m["tools/mixed_call_groups"] == pytest.approx(2 / 4)
    assert m["tools/mixed_call_groups_kept"] == pytest.approx(1 / 2)
    assert m["tools/call_rate_kept"] == pytest.approx(6 / 12)


def test_absent_kinds_are_left_out_and_plain_responses_have_none():
    never = _group((False, True), (False, False))
    m = call_outcome_metrics([never], [never])
    assert "tools/acc_called" not in m and "tools/mixed_call_groups_kept" not in m
    assert m["tools/mixed_call_groups"] == 0.0 and m["tools/call_rate_kept"] == 0.0
    plain = SimpleNamespace(samples=[SimpleNamespace(episode=None, acc=True)])
    assert call_outcome_metrics([plain], [plain]) == {}
