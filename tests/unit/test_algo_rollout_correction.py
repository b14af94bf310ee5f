"""Rollout correction against float64 formulas, and the global token-mean with it on."""

import math

import pytest
import torch

from megatron_dapo.algo import compute_policy_loss
from megatron_dapo.algo.rollout_correction import CorrectionStats, rollout_correction


def _batch(seed: int, rows: int = 6, width: int = 9, scale: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    old = rollout + torch.randn(rows, width, generator=g, dtype=torch.float64) * scale
    mask = torch.rand(rows, width, generator=g) < 0.8
    mask[0] = False  # a row without response tokens
    return old, rollout, mask


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_is_weights_are_truncated_ratios_at_their_level(level):
    old, rollout, mask = _batch(1)
    weights, keep, stats = rollout_correction(old, rollout, mask, is_level=level, is_threshold=1.5)
    lr = torch.where(mask, old - rollout, 0.0)
    for b in range(mask.shape[0]):
        n = int(mask[b].sum())
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                assert weights[b, t] == 0
                continue
            raw = {"token": math.exp(float(lr[b, t])), "sequence": math.exp(float(lr[b].sum())),
                   "geometric": math.exp(float(lr[b].sum()) / n)}[level]
            assert float(weights[b, t]) == pytest.approx(min(raw, 1.5), rel=1e-6)
    assert torch.equal(keep, mask)
    assert stats.num_truncated == pytest.approx(float(((weights == 1.5) & mask).sum()))


def test_mismatch_kl_estimators_match_float64_formulas():
    old, rollout, mask = _batch(2)
    _, _, stats = rollout_correction(old, rollout, mask)
    lr = (old - rollout)[mask]
    assert stats.kl_k1 == pytest.approx(float((-lr).sum()), rel=1e-12)
    assert stats.kl_k3 == pytest.approx(float((lr.exp() - 1 - lr).sum()), rel=1e-12)
    assert stats.kl_k3 >= 0 and stats.num_tokens == float(mask.sum())


@pytest.mark.parametrize(("level", "lower", "upper"), [("token", 0.8, 1.3), ("sequence", 0.8, 1.3),
                                                      ("geometric", 0.97, 1.03)])
def test_rejection_removes_tokens_or_whole_sequences_outside_the_bounds(level, lower, upper):
    old, rollout, mask = _batch(3, scale=0.5)
    weights, keep, stats = rollout_correction(old, rollout, mask, rs_level=level, rs_upper=upper, rs_lower=lower)
    assert weights is None
    lr = torch.where(mask, old - rollout, 0.0)
    ratio = {"token": lr.exp(), "sequence": lr.sum(-1, keepdim=True).exp().expand_as(lr),
             "geometric": (lr.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).exp().expand_as(lr)}[level]
    expected = mask & (ratio <= upper) & (ratio >= lower)
    assert torch.equal(keep, expected)
    assert 0 < stats.num_rejected_tokens == float((mask & ~expected).sum())
    if level != "token":  # a sequence is kept or rejected whole
        assert all(bool(keep[b][mask[b]].all()) or not bool(keep[b].any()) for b in range(mask.shape[0]))


def test_long_sequences_do_not_overflow():
    old = torch.zeros(1, 5000, dtype=torch.float64)
    rollout = old - 0.5  # product of ratios e^2500
    weights, _, stats = rollout_correction(old, rollout, torch.ones(1, 5000, dtype=torch.bool), is_level="sequence")
    assert torch.isfinite(weights).all() and float(weights.max()) == 2.0 and math.isfinite(stats.weight_max)


def test_token_mean_over_micro_batches_holds_with_weights_and_rejection():
    old, rollout, mask = _batch(4, rows=8)
    weights, keep, _ = rollout_correction(old, rollout, mask, is_level="token", is_threshold=1.2,
                                          rs_level="token", rs_upper=1.4, rs_lower=0.7)
    g = torch.Generator().manual_seed(5)
    log_prob = (old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.1).requires_grad_(True)
    adv = torch.randn(8, 1, generator=g, dtype=torch.float64).expand_as(old)
    n = int(keep.sum())
    whole, _ = compute_policy_loss(log_prob, old, adv, keep, 0.2, 0.28, is_weights=weights, num_global_tokens=n)
    parts = sum(compute_policy_loss(log_prob[s], old[s], adv[s], keep[s], 0.2, 0.28, is_weights=weights[s],
                                    num_global_tokens=n)[0] for s in (slice(0, 3), slice(3, 8)))
    assert float(whole) == pytest.approx(float(parts), rel=1e-12)
    # The weights scale each token's loss: with weights 1 the loss is the plain one.
    plain, _ = compute_policy_loss(log_prob, old, adv, keep, 0.2, 0.28, num_global_tokens=n)
    ones, _ = compute_policy_loss(log_prob, old, adv, keep, 0.2, 0.28, is_weights=keep.double(), num_global_tokens=n)
    assert float(plain) == pytest.approx(float(ones), rel=1e-12) and float(plain) != pytest.approx(float(whole))


def test_metrics_are_global_means_of_the_summed_stats():
    old, rollout, mask = _batch(6)
    halves = [rollout_correction(old[s], rollout[s], mask[s], is_level="token")[2] for s in (slice(0, 3), slice(3, 6))]
    whole = rollout_correction(old, rollout, mask, is_level="token")[2]
    summed = halves[0].as_tensor() + halves[1].as_tensor()
    merged = CorrectionStats.metrics(summed, max(h.weight_max for h in halves))
    expected = CorrectionStats.metrics(whole.as_tensor(), whole.weight_max)
    assert merged == pytest.approx(expected, rel=1e-12)
