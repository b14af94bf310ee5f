"""Dynamic sampling: the group filter and the buffer that fills a training batch."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.algo import (
    DynamicSamplingBuffer,
    DynamicSamplingError,
    GroupFilterStats,
    RoundStats,
    filter_groups,
)


def test_filter_groups_hand_worked():
    # group 5: 1 1 all-correct | 2: 0 1 kept | 9: 0 0 all-wrong | 4: .5 .5 other constant
    # 7: a single 1, constant, so all-correct | 3: 1 0 1 kept. Kept ids come out ascending.
    values = torch.tensor([1, 1, 0, 1, 0, 0, 0.5, 0.5, 1, 1, 0, 1])
    ids = torch.tensor([5, 5, 2, 2, 9, 9, 4, 4, 7, 3, 3, 3])
    kept, stats = filter_groups(values, ids)
    assert kept.tolist() == [2, 3]
    assert stats == GroupFilterStats(
        num_groups=6, num_kept=2, num_dropped_all_correct=2, num_dropped_all_wrong=1, num_dropped_other=1
    )


def test_filter_groups_on_plus_minus_one_scores():
    # The DAPO reward is +-1: a constant -1 group is all-wrong (<= wrong_at 0).
    kept, stats = filter_groups(torch.tensor([-1.0, -1.0, 1.0, -1.0]), torch.tensor([0, 0, 1, 1]))
    assert kept.tolist() == [1]
    assert (stats.num_dropped_all_wrong, stats.num_dropped_all_correct) == (1, 0)


def test_filter_groups_empty_and_shape_errors():
    kept, stats = filter_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert kept.numel() == 0 and stats.num_groups == 0
    with pytest.raises(ValueError, match=r"metric_values \(2,\) and group_index \(3,\)"):
        filter_groups(torch.zeros(2), torch.zeros(3, dtype=torch.long))


def test_buffer_keeps_first_come_and_trims_to_the_target():
    buffer = DynamicSamplingBuffer(target_num_groups=3, max_num_gen_batches=5)
    first = buffer.add_round(["a", "b", "c", "d"], [[0, 1], [1, 0], [1, 1], [0, 0]])
    assert first == RoundStats(
        num_groups=4,
        num_kept=2,
        num_dropped_all_correct=1,
        num_dropped_all_wrong=1,
        num_dropped_other=0,
        round_index=1,
        num_buffered=2,
    )
    assert not buffer.is_full
    second = buffer.add_round(["e", "f", "g"], [[1, 0, 1], [1, 1, 1], [0, 1, 0]])
    assert (second.round_index, second.num_kept, second.num_buffered) == (2, 2, 4)
    assert buffer.is_full
    assert buffer.take() == ["a", "b", "e"]  # "g" is surplus
    assert (buffer.num_buffered, buffer.num_rounds, buffer.is_full) == (0, 0, False)


def test_buffer_raises_after_max_rounds_with_the_documented_message():
    buffer = DynamicSamplingBuffer(target_num_groups=5, max_num_gen_batches=2)
    buffer.add_round(["a", "b", "c"], [[0, 1], [1, 1], [0, 0]])
    with pytest.raises(DynamicSamplingError) as info:
        buffer.add_round(["d", "e", "f"], [[1, 0], [0, 0], [0, 0]])
    assert isinstance(info.value, RuntimeError)
    assert str(info.value) == (
        "dynamic sampling kept 2 of the 5 groups a training batch needs after 2 generation rounds "
        "(algorithm.filter_groups.max_num_gen_batches=2); 4 groups were dropped for having the same "
        "metric in every response: 1 all-correct, 3 all-wrong, 0 constant at another value. Fix: raise "
        "algorithm.filter_groups.max_num_gen_batches (0 = unlimited) or data.gen_batch_size, or check "
        "the reward and the task difficulty (mostly all-correct: too easy; mostly all-wrong: too hard "
        "or the reward never matches)"
    )
    assert buffer.num_buffered == 2  # the caller may still inspect what was kept


def test_buffer_that_fills_on_the_last_allowed_round_does_not_raise():
    buffer = DynamicSamplingBuffer(target_num_groups=2, max_num_gen_batches=2)
    buffer.add_round(["a"], [[0, 1]])
    assert buffer.add_round(["b"], [[1, 0]]).num_buffered == 2
    assert buffer.take() == ["a", "b"]


def test_zero_max_rounds_is_unlimited():
    buffer = DynamicSamplingBuffer(target_num_groups=1, max_num_gen_batches=0)
    for _ in range(50):
        buffer.add_round(["all-wrong"], [[0, 0, 0]])
    assert buffer.num_rounds == 50
    buffer.add_round(["x"], [[0, 1, 0]])
    assert buffer.take() == ["x"]


def test_state_dict_round_trip_through_json():
    payload = [{"prompt": [1, 2], "responses": [[3], [4]]}, {"prompt": [5], "responses": [[6], [7]]}]
    original = DynamicSamplingBuffer(target_num_groups=3, max_num_gen_batches=3)
    original.add_round(payload, [[1, 0], [1, 1]])
    state = json.loads(json.dumps(original.state_dict()))  # plain python containers only
    restored = DynamicSamplingBuffer(target_num_groups=3, max_num_gen_batches=3)
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()
    assert (restored.num_buffered, restored.num_rounds) == (1, 1)
    # The restored buffer continues exactly like the original, drop counts included.
    for buffer in (original, restored):
        buffer.add_round(["p"], [[0, 0]])
        with pytest.raises(
            DynamicSamplingError,
            match=r"kept 1 of the 3 groups .* after 3 generation .* 1 all-correct, 2 all-wrong",
        ):
            buffer.add_round(["q"], [[0, 0]])
    with pytest.raises(ValueError, match="dynamic sampling state has version 7, this code reads version 1"):
        restored.load_state_dict({**state, "version": 7})


def test_buffer_input_errors():
    with pytest.raises(ValueError, match=r"target_num_groups=0 \(data.train_batch_size\) must be > 0"):
        DynamicSamplingBuffer(target_num_groups=0, max_num_gen_batches=1)
    with pytest.raises(ValueError, match="max_num_gen_batches=-1 must be >= 0"):
        DynamicSamplingBuffer(target_num_groups=1, max_num_gen_batches=-1)
    buffer = DynamicSamplingBuffer(target_num_groups=2, max_num_gen_batches=0)
    with pytest.raises(ValueError, match="add_round got 2 groups but 1 metric lists"):
        buffer.add_round(["a", "b"], [[0, 1]])
    with pytest.raises(ValueError, match="group 1 of this round has no metric values"):
        buffer.add_round(["a", "b"], [[0, 1], []])
    with pytest.raises(RuntimeError, match="take\\(\\) with 0 of 2 groups buffered"):
        buffer.take()


@settings(max_examples=40, deadline=None)
@given(
    rounds=st.lists(
        st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=4), min_size=1, max_size=6),
        min_size=1,
        max_size=8,
    ),
    target=st.integers(1, 10),
)
def test_filled_batches_hold_exactly_the_first_groups_with_spread(rounds, target):
    buffer = DynamicSamplingBuffer(target_num_groups=target, max_num_gen_batches=0)
    with_spread = []
    for r, metrics in enumerate(rounds):
        groups = [(r, g, tuple(values)) for g, values in enumerate(metrics)]
        buffer.add_round(groups, metrics)
        with_spread += [group for group in groups if 0 < sum(group[2]) < len(group[2])]
        if buffer.is_full:
            break
    assert buffer.num_buffered == len(with_spread)
    if len(with_spread) >= target:
        batch = buffer.take()
        assert batch == with_spread[:target]
        assert all(0 < sum(values) / len(values) < 1 for _, _, values in batch)
    else:
        assert not buffer.is_full
