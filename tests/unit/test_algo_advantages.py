"""Group-relative advantages: hand-worked cases, a float64 loop reference, properties."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.algo import compute_group_advantages


def _reference(scores: list[float], ids: list[int], eps: float, norm_by_std: bool) -> list[float]:
    """Straightforward per-response loop in python floats (float64)."""
    out = []
    for score, gid in zip(scores, ids):
        group = [s for s, g in zip(scores, ids) if g == gid]
        if len(group) == 1:
            out.append(0.0)
            continue
        deviation = score - statistics.fmean(group)
        out.append(deviation / (statistics.stdev(group) + eps) if norm_by_std else deviation)
    return out


def test_dapo_rewards_hand_worked():
    # Group 42: rewards 1, 1, 1, -1 -> mean 0.5, deviations .5 .5 .5 -1.5,
    # squared sum .25 * 3 + 2.25 = 3, unbiased variance 3 / (4 - 1) = 1, std 1,
    # so A = deviation / (1 + 1e-6).
    # Group -3: rewards 1, 0 -> mean .5, variance (.25 + .25) / 1 = .5, std 0.70710678,
    # A = +-.5 / 0.70710678 = +-0.70710578 (with eps).
    # Ids are interleaved and not contiguous.
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, -1.0], dtype=torch.float64)
    ids = torch.tensor([42, -3, 42, -3, 42, 42])
    adv = compute_group_advantages(scores, ids)
    half_over_std = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = [
        0.5 / (1 + 1e-6),
        half_over_std,
        0.5 / (1 + 1e-6),
        -half_over_std,
        0.5 / (1 + 1e-6),
        -1.5 / (1 + 1e-6),
    ]
    assert adv.tolist() == pytest.approx(expected, rel=1e-12)


def test_dr_grpo_skips_std():
    # Same group of four: R - mean = .5, .5, .5, -1.5, no division.
    adv = compute_group_advantages(
        torch.tensor([1.0, 1.0, 1.0, -1.0]), torch.tensor([0, 0, 0, 0]), norm_by_std=False
    )
    assert adv.tolist() == [0.5, 0.5, 0.5, -1.5]


def test_singletons_and_constant_groups_get_zero():
    # Group 7 has one member (reward 5); group 1 is constant (all 1): both exactly 0.
    adv = compute_group_advantages(torch.tensor([5.0, 1.0, 1.0, 1.0]), torch.tensor([7, 1, 1, 1]))
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_keeps_dtype_and_handles_empty():
    adv = compute_group_advantages(torch.tensor([1.0, 0.0], dtype=torch.bfloat16), torch.tensor([3, 3]))
    assert adv.dtype == torch.bfloat16
    assert adv.float().tolist() == pytest.approx([0.70710678, -0.70710678], rel=1e-2)
    assert compute_group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_bad_inputs_name_the_shapes():
    with pytest.raises(ValueError, match=r"scores \(3,\) and group_index \(2,\)"):
        compute_group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"integer prompt ids, got dtype torch\.float32"):
        compute_group_advantages(torch.zeros(2), torch.zeros(2))


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_matches_float64_loop_on_random_batches(norm_by_std):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        ids = torch.randint(-5, 6, (n,), generator=gen) * 1000
        scores = torch.randn(n, generator=gen, dtype=torch.float64)
        adv = compute_group_advantages(scores, ids, eps=1e-6, norm_by_std=norm_by_std)
        ref = _reference(scores.tolist(), ids.tolist(), 1e-6, norm_by_std)
        assert adv.tolist() == pytest.approx(ref, rel=1e-9, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=8), min_size=1, max_size=6
    ),
    perm_seed=st.integers(0, 2**16),
)
def test_per_group_mean_is_zero_and_order_does_not_matter(groups, perm_seed):
    scores = torch.tensor([s for g in groups for s in g], dtype=torch.float64)
    ids = torch.tensor([3 * i + 11 for i, g in enumerate(groups) for _ in g])
    adv = compute_group_advantages(scores, ids)
    for gid in ids.unique():
        members = adv[ids == gid]
        assert abs(float(members.mean())) < 1e-9
        spread = float(scores[ids == gid].std())
        if spread > 1e-3:
            # Unbiased std of (R - mean) / (std + eps) is std / (std + eps).
            assert float(members.std()) == pytest.approx(spread / (spread + 1e-6), rel=1e-9)
    # Shuffling the responses shuffles the advantages the same way (up to summation order).
    perm = torch.randperm(len(scores), generator=torch.Generator().manual_seed(perm_seed))
    torch.testing.assert_close(
        compute_group_advantages(scores[perm], ids[perm]), adv[perm], rtol=1e-12, atol=1e-12
    )
