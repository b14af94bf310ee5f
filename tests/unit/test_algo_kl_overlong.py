"""KL estimators, soft overlong punishment and overlong filtering."""

import math

import pytest
import torch

from megatron_dapo.algo import KL_KINDS, kl_penalty, overlong_filter_mask, soft_overlong_penalty

# ----------------------------------------------------------------------------- KL


def test_kl_estimators_hand_worked():
    # d = log_prob - ref = 0.5 and -1.
    log_prob = torch.tensor([[0.5, -1.0]], dtype=torch.float64)
    ref = torch.zeros_like(log_prob)
    assert kl_penalty(log_prob, ref, "k1").tolist() == [[0.5, -1.0]]
    assert kl_penalty(log_prob, ref, "k2").tolist() == [[0.125, 0.5]]  # d^2 / 2
    assert kl_penalty(log_prob, ref, "abs").tolist() == [[0.5, 1.0]]
    # k3 = exp(-d) + d - 1: e^-0.5 - 0.5 = 0.10653066, e^1 - 2 = 0.71828183.
    expected_k3 = [math.exp(-0.5) - 0.5, math.e - 2.0]
    assert kl_penalty(log_prob, ref, "k3")[0].tolist() == pytest.approx(expected_k3, rel=1e-12)
    assert torch.equal(kl_penalty(log_prob, ref, "low_var_kl"), kl_penalty(log_prob, ref, "k3"))


def test_k3_is_clamped_like_verl():
    # d = -30: -d clamped to 20, e^20 - 21 >> 10 -> 10. d = 30: -d -> -20, e^-20 + 19 -> 10.
    log_prob = torch.tensor([[-30.0, 30.0]], dtype=torch.float64)
    assert kl_penalty(log_prob, torch.zeros_like(log_prob), "k3").tolist() == [[10.0, 10.0]]


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_unbiased_estimators_average_to_the_exact_kl(kind):
    # Over a categorical pi, E_{x~pi}[k1] = E[k3] = KL(pi || ref) exactly (E_pi[ref/pi] = 1).
    gen = torch.Generator().manual_seed(3)
    log_pi = torch.log_softmax(torch.randn(1, 9, generator=gen, dtype=torch.float64), dim=-1)
    log_ref = torch.log_softmax(torch.randn(1, 9, generator=gen, dtype=torch.float64), dim=-1)
    exact = float((log_pi.exp() * (log_pi - log_ref)).sum())
    expectation = float((log_pi.exp() * kl_penalty(log_pi, log_ref, kind)).sum())
    assert expectation == pytest.approx(exact, rel=1e-12)


def test_unknown_kl_kind_names_the_value():
    assert KL_KINDS == ("k1", "k2", "k3", "low_var_kl", "abs")
    with pytest.raises(ValueError, match=r"'k4' \(algorithm.kl_loss_type\); use one of k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ----------------------------------------------------------------------------- overlong


def test_soft_penalty_at_the_boundaries():
    # L_max 20, L_cache 4: no penalty up to 16, then (16 - L) / 4: 17 -> -.25, 18 -> -.5,
    # 20 (= L_max) -> -1, beyond -> clamped at -1.
    lengths = torch.tensor([0, 15, 16, 17, 18, 19, 20, 25])
    penalty = soft_overlong_penalty(lengths, max_response_length=20, buffer_len=4, penalty_factor=1.0)
    assert penalty.dtype == torch.float32
    assert penalty.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    half = soft_overlong_penalty(lengths, max_response_length=20, buffer_len=4, penalty_factor=0.5)
    assert half.tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5]


def test_soft_penalty_paper_setting():
    # DAPO: L_max 20480 = 16384 expected + 4096 cache; midway 18432 is -0.5.
    lengths = torch.tensor([16384, 16385, 18432, 20480])
    penalty = soft_overlong_penalty(lengths, max_response_length=20480, buffer_len=4096, penalty_factor=1.0)
    assert penalty.tolist() == [0.0, -1 / 4096, -0.5, -1.0]


@pytest.mark.parametrize("buffer_len", [0, 20, 30])
def test_soft_penalty_rejects_a_buffer_that_does_not_fit(buffer_len):
    message = (
        rf"reward.overlong_buffer.len={buffer_len} must be > 0 and < data.max_response_length=20, .*"
        "shrink the buffer"
    )
    with pytest.raises(ValueError, match=message):
        soft_overlong_penalty(
            torch.tensor([1]), max_response_length=20, buffer_len=buffer_len, penalty_factor=1.0
        )
    with pytest.raises(ValueError, match=r"penalty_factor=-1.0 must be >= 0"):
        soft_overlong_penalty(torch.tensor([1]), max_response_length=20, buffer_len=4, penalty_factor=-1.0)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.int64])
def test_overlong_filter_zeroes_truncated_rows(dtype):
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]]).to(dtype)
    filtered = overlong_filter_mask(mask, torch.tensor([False, True, False]))
    assert filtered.dtype == dtype
    assert filtered.to(torch.int64).tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    with pytest.raises(
        ValueError, match=r"truncated \(2,\) must have one flag per row of response_mask \(3, 3\)"
    ):
        overlong_filter_mask(mask, torch.tensor([True, False]))
