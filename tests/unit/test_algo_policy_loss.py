"""Clip-Higher policy loss and its aggregation: hand cases, a float64 loop reference,
and the invariance that makes token-mean global (micro-batch / DP splits change nothing)."""

import itertools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_dapo.algo import LOSS_AGG_MODES, agg_loss, compute_policy_loss, count_tokens_and_seqs

EPS_LOW, EPS_HIGH = 0.2, 0.28


# ----------------------------------------------------------------------------- agg_loss


def _hand_batch() -> tuple[torch.Tensor, torch.Tensor]:
    # Row 0: tokens 1, 2 valid (3 padding); row 1: token 4 valid; row 2: nothing valid,
    # and its padding holds NaN, which must not leak into any mode.
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [float("nan"), 8.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    return loss_mat, mask


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 valid tokens
        ("seq-mean-token-mean", 2.75),  # ((1 + 2) / 2 + 4 / 1) / 2 non-empty sequences
        ("seq-mean-token-sum", 3.5),  # ((1 + 2) + 4) / 2
        ("seq-mean-token-sum-norm", 7 / 6),  # ((1 + 2) + 4) / 2 / loss_scale_factor=3
    ],
)
def test_agg_modes_hand_worked(mode, expected):
    loss_mat, mask = _hand_batch()
    assert agg_loss(loss_mat, mask, mode, loss_scale_factor=3).item() == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_does_not_depend_on_the_padded_width(mode):
    # The same sequences in a batch whose longest prompt + response is 3 or 40 tokens wide
    # (padding after them): every mode, sum-norm included, gives the same loss.
    loss_mat, mask = _hand_batch()
    wide_mat = torch.cat([loss_mat, torch.full((3, 37), 5.0, dtype=torch.float64)], dim=1)
    wide_mask = torch.cat([mask, torch.zeros(3, 37, dtype=mask.dtype)], dim=1)
    narrow = agg_loss(loss_mat, mask, mode, loss_scale_factor=16)
    assert agg_loss(wide_mat, wide_mask, mode, loss_scale_factor=16).item() == narrow.item()


def test_agg_global_counts_and_scale_factor():
    loss_mat, mask = _hand_batch()
    # Local sum 7 over a global count of 14 tokens.
    assert agg_loss(loss_mat, mask, "token-mean", num_global_tokens=14).item() == 0.5
    # Sequence sums 3 + 4 over 7 global sequences; -norm also divides by the factor 2.
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum", num_global_seqs=torch.tensor(7)).item() == 1.0
    assert (
        agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", num_global_seqs=7, loss_scale_factor=2).item()
        == 0.5
    )
    # seq-mean-token-mean: (1.5 + 4) / 11 global sequences.
    assert agg_loss(loss_mat, mask, "seq-mean-token-mean", num_global_seqs=11).item() == pytest.approx(0.5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_all_masked_is_zero_not_nan(mode):
    loss_mat = torch.ones(2, 3, requires_grad=True)
    for kwargs in ({"loss_scale_factor": 5}, {"num_global_tokens": 0, "num_global_seqs": 0, "loss_scale_factor": 5}):
        loss = agg_loss(loss_mat, torch.zeros(2, 3, dtype=torch.bool), mode, **kwargs)
        loss.backward()
        assert loss.item() == 0.0
        assert torch.equal(loss_mat.grad, torch.zeros(2, 3))


def test_agg_errors_name_the_bad_value():
    with pytest.raises(ValueError, match=r"'token_mean' \(algorithm.loss_agg_mode\); use one of token-mean"):
        agg_loss(torch.ones(1, 2), torch.ones(1, 2), "token_mean")
    with pytest.raises(ValueError, match="loss_scale_factor must be > 0 for seq-mean-token-sum-norm, got 0"):
        agg_loss(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm", loss_scale_factor=0)
    with pytest.raises(ValueError, match="got None; pass a constant such as the maximum response length"):
        agg_loss(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match=r"same \[B, T\] shape, got \(1, 2\) and \(2, 1\)"):
        agg_loss(torch.ones(1, 2), torch.ones(2, 1), "token-mean")


def test_count_tokens_and_seqs():
    _, mask = _hand_batch()
    num_tokens, num_seqs = count_tokens_and_seqs(mask)
    assert (num_tokens.item(), num_seqs.item()) == (3, 2)


# ----------------------------------------------------------------------------- clipping


def _one_row(ratios: list[float], advantages: list[float]) -> tuple[torch.Tensor, ...]:
    log_prob = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(log_prob)
    adv = torch.tensor([advantages], dtype=torch.float64)
    return log_prob, old, adv, torch.ones_like(adv)


def test_clip_higher_and_dual_clip_hand_worked():
    # eps_low .2, eps_high .28, c = 3; per token: max(-A r, -A clip(r, .8, 1.28)), then
    # for A < 0: min(., 3 * -A).
    #  t0 A=+1 r=1.5: max(-1.5, -1.28) = -1.28   clipped
    #  t1 A=+1 r=0.5: max(-0.5, -0.8)  = -0.5    unclipped, d/dlogp = -A r = -0.5
    #  t2 A=-1 r=0.5: max(0.5, 0.8)    =  0.8    clipped
    #  t3 A=-1 r=1.5: max(1.5, 1.28)   =  1.5    unclipped, d/dlogp = -A r = 1.5
    #  t4 A=-1 r=5:   max(5, 1.28) = 5 -> min(5, 3) = 3   dual clip
    #  t5 A=+1 r=5:   max(-5, -1.28)   = -1.28   clipped (dual clip is for A < 0 only)
    # token-mean: (-1.28 - 0.5 + 0.8 + 1.5 + 3 - 1.28) / 6 = 2.24 / 6
    log_prob, old, adv, mask = _one_row([1.5, 0.5, 0.5, 1.5, 5.0, 5.0], [1, 1, -1, -1, -1, 1])
    loss, metrics = compute_policy_loss(log_prob, old, adv, mask, EPS_LOW, EPS_HIGH, clip_ratio_c=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(2.24 / 6, rel=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(3 / 6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)
    # ppo_kl = mean(-log r) = -(2 log 1.5 + 2 log .5 + 2 log 5) / 6 = -log(3.75) / 3
    assert metrics["ppo_kl"].item() == pytest.approx(-math.log(3.75) / 3, rel=1e-12)
    assert log_prob.grad[0].tolist() == pytest.approx([0.0, -0.5 / 6, 0.0, 1.5 / 6, 0.0, 0.0], rel=1e-12)
    assert not metrics["ppo_kl"].requires_grad

    # Without dual clip t4 stays at 5 and has gradient -A r = 5: (2.24 - 3 + 5) / 6.
    log_prob.grad = None
    loss, metrics = compute_policy_loss(log_prob, old, adv, mask, EPS_LOW, EPS_HIGH)
    loss.backward()
    assert loss.item() == pytest.approx(4.24 / 6, rel=1e-12)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    assert log_prob.grad[0, 4].item() == pytest.approx(5 / 6, rel=1e-12)


def test_advantage_per_response_broadcasts_over_tokens():
    log_prob = torch.log(torch.tensor([[1.5, 0.5], [1.5, 0.5]], dtype=torch.float64))
    old, mask = torch.zeros_like(log_prob), torch.ones_like(log_prob)
    per_response, _ = compute_policy_loss(log_prob, old, torch.tensor([1.0, -1.0]), mask, EPS_LOW, EPS_HIGH)
    per_token, _ = compute_policy_loss(
        log_prob, old, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), mask, EPS_LOW, EPS_HIGH
    )
    # Row 0 (A=+1): -1.28, -0.5; row 1 (A=-1): 1.5, 0.8 -> mean 0.52 / 4 = 0.13.
    assert per_response.item() == per_token.item() == pytest.approx(0.13, rel=1e-12)


def test_nan_padding_gives_finite_loss_and_zero_gradient_there():
    log_prob = torch.tensor([[0.1, float("nan")], [float("-inf"), float("nan")]], requires_grad=True)
    mask = torch.tensor([[True, False], [False, False]])
    loss, metrics = compute_policy_loss(
        log_prob, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), mask, EPS_LOW, EPS_HIGH
    )
    loss.backward()
    # One valid token, A=+1, r = e^0.1 = 1.105 < 1.28: loss -1.105, gradient -1.105.
    assert loss.item() == pytest.approx(-math.exp(0.1), rel=1e-6)
    assert log_prob.grad.flatten().tolist() == pytest.approx([-math.exp(0.1), 0.0, 0.0, 0.0], rel=1e-6)
    assert all(math.isfinite(v.item()) for v in metrics.values())


def test_policy_loss_errors_name_the_bad_value():
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"clip_ratio_c=1.0 \(algorithm.clip_ratio_c\) must be > 1"):
        compute_policy_loss(*args, EPS_LOW, EPS_HIGH, clip_ratio_c=1.0)
    with pytest.raises(
        ValueError, match=r"clip_ratio_low=1.5 \(algorithm.clip_ratio_low\) must be in \[0, 1\]"
    ):
        compute_policy_loss(*args, 1.5, EPS_HIGH)
    with pytest.raises(ValueError, match=r"loss_mode='gspo' clips the ratio: pass clip_ratio_low"):
        compute_policy_loss(*args, None, EPS_HIGH, loss_mode="gspo")
    with pytest.raises(ValueError, match=r"unknown loss_mode 'dapo' \(algorithm.policy_loss.loss_mode\); use one of"):
        compute_policy_loss(*args, EPS_LOW, EPS_HIGH, loss_mode="dapo")
    with pytest.raises(ValueError, match=r"clip_ratio_high=-0.1 \(algorithm.clip_ratio_high\) must be >= 0"):
        compute_policy_loss(*args, EPS_LOW, -0.1)
    with pytest.raises(ValueError, match=r"advantages of shape \(3,\) fit neither \[B\]=1"):
        compute_policy_loss(args[0], args[1], torch.ones(3), args[3], EPS_LOW, EPS_HIGH)


@settings(max_examples=80, deadline=None)
@given(
    eps=st.floats(0.01, 0.6),
    magnitude=st.floats(0.1, 5.0),
    upper=st.booleans(),
)
def test_ratio_exactly_on_the_clip_boundary(eps, magnitude, upper):
    # Upper bound 1 + eps matters for A > 0, lower bound 1 - eps for A < 0. Exactly on the
    # bound the clipped branch equals the unclipped one: not counted, full gradient -A r.
    # One step past it the token is clipped: counted, zero gradient. One step inside: not.
    bound = 1.0 + eps if upper else 1.0 - eps
    advantage = magnitude if upper else -magnitude
    on_bound = math.log(bound)
    assume(torch.exp(torch.tensor(on_bound, dtype=torch.float64)).item() == bound)
    beyond = 1e-9 if upper else -1e-9
    for log_r, expect_clipped in ((on_bound, False), (on_bound + beyond, True), (on_bound - beyond, False)):
        log_prob = torch.tensor([[log_r]], dtype=torch.float64, requires_grad=True)
        loss, metrics = compute_policy_loss(
            log_prob,
            torch.zeros(1, 1, dtype=torch.float64),
            torch.tensor([advantage], dtype=torch.float64),
            torch.ones(1, 1),
            eps,
            eps,
        )
        loss.backward()
        ratio = math.exp(log_r)
        assert metrics["pg_clipfrac"].item() == float(expect_clipped)
        assert log_prob.grad.item() == (
            0.0 if expect_clipped else pytest.approx(-advantage * ratio, rel=1e-12)
        )
        # The loss is continuous across the bound: -A * bound up to the 1e-9 step.
        assert loss.item() == pytest.approx(-advantage * bound, rel=1e-8)


# ----------------------------------------------------------------------------- references


def _reference_loss(log_prob, old, adv, mask, eps_low, eps_high, clip_c, mode, scale):
    """Per-token, per-sequence python loops in float64, written from the formulas."""
    seq_values, all_tokens = [], []
    for b in range(len(log_prob)):
        a_row = adv[b] if isinstance(adv[b], list) else [adv[b]] * len(log_prob[b])
        token_losses = []
        for t in range(len(log_prob[b])):
            if not mask[b][t]:
                continue
            a = a_row[t]
            r = math.exp(min(max(log_prob[b][t] - old[b][t], -20.0), 20.0))
            value = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
            if clip_c is not None and a < 0:
                value = min(value, -a * clip_c)
            token_losses.append(value)
        all_tokens.extend(token_losses)
        if token_losses:
            total = sum(token_losses)
            seq_values.append(total / len(token_losses) if mode == "seq-mean-token-mean" else total)
    if mode == "token-mean":
        return sum(all_tokens) / max(len(all_tokens), 1)
    loss = sum(seq_values) / max(len(seq_values), 1)
    return loss / scale if mode == "seq-mean-token-sum-norm" else loss


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_matches_float64_loop_reference(mode, clip_c):
    gen = torch.Generator().manual_seed(1)
    for trial in range(10):
        b, t = 5, 7
        log_prob = torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3 - 1.0
        old = log_prob + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.6
        mask = torch.rand(b, t, generator=gen) < 0.7
        mask[0] = False  # one sequence without valid tokens
        per_token = trial % 2 == 0
        adv = (
            torch.randn(b, t, generator=gen, dtype=torch.float64)
            if per_token
            else torch.randn(b, generator=gen, dtype=torch.float64)
        )
        loss, _ = compute_policy_loss(log_prob, old, adv, mask, EPS_LOW, EPS_HIGH, clip_c, mode, loss_scale_factor=t)
        ref = _reference_loss(
            log_prob.tolist(), old.tolist(), adv.tolist(), mask.tolist(), EPS_LOW, EPS_HIGH, clip_c, mode, t
        )
        assert loss.item() == pytest.approx(ref, rel=1e-12, abs=1e-15)


# ----------------------------------------------------------------------------- invariance


@st.composite
def _split_batches(draw):
    b = draw(st.integers(1, 6))
    t = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**16))
    order = draw(st.permutations(range(b)))
    cuts = sorted(draw(st.sets(st.integers(1, b - 1), max_size=b - 1))) if b > 1 else []
    bounds = [0, *cuts, b]
    chunks = [list(order[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
    return b, t, seed, chunks


@settings(max_examples=40, deadline=None)
@given(batch=_split_batches(), mode=st.sampled_from(LOSS_AGG_MODES), clip_c=st.sampled_from([None, 3.0]))
def test_micro_batches_with_global_counts_sum_to_the_whole_batch(batch, mode, clip_c):
    # Any split of the rows (micro-batches, or DP ranks: the same sum) with the counts
    # of the whole batch gives the whole batch's loss, gradient and metrics.
    b, t, seed, chunks = batch
    gen = torch.Generator().manual_seed(seed)
    log_prob = (torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    old = log_prob.detach() + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = torch.rand(b, t, generator=gen) < 0.6
    kwargs = {"clip_ratio_c": clip_c, "loss_agg_mode": mode, "loss_scale_factor": 7.0}

    whole, whole_metrics = compute_policy_loss(log_prob, old, adv, mask, EPS_LOW, EPS_HIGH, **kwargs)
    (whole_grad,) = torch.autograd.grad(whole, log_prob)

    num_tokens, num_seqs = count_tokens_and_seqs(mask)
    total = torch.zeros((), dtype=torch.float64)
    metric_sums = dict.fromkeys(whole_metrics, 0.0)
    for rows in chunks:
        idx = torch.tensor(rows)
        part, part_metrics = compute_policy_loss(
            log_prob[idx],
            old[idx],
            adv[idx],
            mask[idx],
            EPS_LOW,
            EPS_HIGH,
            num_global_tokens=num_tokens,
            num_global_seqs=num_seqs,
            **kwargs,
        )
        total = total + part
        for name, value in part_metrics.items():
            metric_sums[name] += value.item()
    (split_grad,) = torch.autograd.grad(total, log_prob)

    assert total.item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-12, atol=1e-14)
    for name, value in whole_metrics.items():
        assert metric_sums[name] == pytest.approx(value.item(), rel=1e-12, abs=1e-14)


def test_bf16_inputs_give_fp32_metrics():
    # 3 of 4 tokens clipped (A=+1, r=e^0.5=1.65 > 1.28); the fraction must be exact.
    log_prob = torch.tensor([[0.5, 0.5, 0.5, 0.0]], dtype=torch.bfloat16)
    _, metrics = compute_policy_loss(
        log_prob, torch.zeros_like(log_prob), torch.ones(1), torch.ones(1, 4), EPS_LOW, EPS_HIGH
    )
    assert metrics["pg_clipfrac"].dtype == torch.float32
    assert metrics["pg_clipfrac"].item() == 0.75
