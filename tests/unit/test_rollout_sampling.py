"""Sampling (rollout/local/sampling.py) against an independent float64 reference on a small vocabulary."""

import math

import pytest
import torch

from megatron_dapo.rollout.local.sampling import counter_uniforms, sample_next_tokens, truncated_distribution

LOGITS = torch.tensor([2.0, 0.5, 1.7, -1.0, 0.9, 3.1, -0.3, 1.2, 0.0, 2.6, -2.0, 1.4])


def _reference(logits: list[float], temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """Token -> sampling probability, in plain Python floats (no torch)."""
    z = [x / temperature for x in logits]
    m = max(z)
    weights = [math.exp(v - m) for v in z]
    total = sum(weights)
    probs = sorted(((w / total, tok) for tok, w in enumerate(weights)), key=lambda pt: (-pt[0], pt[1]))
    if top_k > 0:
        probs = probs[:top_k]
    mass = sum(p for p, _ in probs)
    probs = [(p / mass, t) for p, t in probs]
    kept, before = [], 0.0
    for p, t in probs:
        if before < top_p:
            kept.append((p, t))
        before += p
    mass = sum(p for p, _ in kept)
    return {t: p / mass for p, t in kept}


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, -1, 1.0), (0.7, 4, 1.0), (1.3, -1, 0.8), (0.7, 5, 0.75), (2.0, 3, 0.5)],
)
def test_sampling_support_and_frequencies_match_float64_reference(temperature, top_k, top_p):
    expected = _reference(LOGITS.tolist(), temperature, top_k, top_p)
    num_rows = 6000
    logits = LOGITS.expand(num_rows, -1).float()
    uniforms = counter_uniforms(torch.arange(1000, 1000 + num_rows), torch.zeros(num_rows, dtype=torch.long))
    tokens, logprobs = sample_next_tokens(
        logits, temperature=temperature, top_k=top_k, top_p=top_p, uniforms=uniforms
    )
    counts = torch.bincount(tokens, minlength=LOGITS.numel())
    # Exact support: never a token outside the top-k/top-p set.
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(expected)
    for tok, p in expected.items():
        sigma = math.sqrt(num_rows * p * (1 - p)) + 1e-9
        assert abs(counts[tok].item() - num_rows * p) < 5 * sigma + 1, (tok, counts[tok].item(), num_rows * p)
    # Reported log-prob: full-vocabulary log_softmax(logits / T), before truncation.
    full = torch.log_softmax(LOGITS.double() / temperature, dim=-1)
    torch.testing.assert_close(logprobs, full[tokens], rtol=0, atol=1e-12)


def test_truncated_distribution_equals_reference_exactly():
    for temperature, top_k, top_p in [(0.7, 5, 0.75), (1.0, -1, 0.3), (1.5, 2, 1.0)]:
        logp = torch.log_softmax(LOGITS.double() / temperature, dim=-1).unsqueeze(0)
        probs, order = truncated_distribution(logp, top_k=top_k, top_p=top_p)
        got = {int(order[0, i]): float(probs[0, i]) for i in range(probs.shape[1]) if probs[0, i] > 0}
        expected = _reference(LOGITS.tolist(), temperature, top_k, top_p)
        assert got.keys() == expected.keys()
        for tok in expected:
            assert got[tok] == pytest.approx(expected[tok], rel=1e-12)


def test_tiny_top_p_and_top_k_1_are_argmax():
    logits = LOGITS.expand(50, -1)
    for kwargs in ({"top_k": 1, "top_p": 1.0}, {"top_k": -1, "top_p": 1e-6}):
        uniforms = counter_uniforms(torch.arange(50), torch.zeros(50, dtype=torch.long))
        tokens, _ = sample_next_tokens(logits, temperature=1.0, uniforms=uniforms, **kwargs)
        assert tokens.tolist() == [5] * 50


def test_greedy_is_argmax_with_temperature_one_logprob():
    logits = torch.stack([LOGITS, -LOGITS])
    tokens, logprobs = sample_next_tokens(logits, temperature=0, top_k=-1, top_p=1.0, uniforms=None)
    assert tokens.tolist() == [5, 10]
    expected = torch.log_softmax(logits.double(), dim=-1)[[0, 1], [5, 10]]
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=0)


def _splitmix64(seed: int, index: int) -> int:
    """The index-th output (0-based) of SplitMix64 seeded by seed, in plain Python integers."""
    mask = (1 << 64) - 1
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_counter_uniforms_are_splitmix64_outputs():
    seeds = [0, 1, 12345, (1 << 63) - 1, 0x5DEECE66D, 987654321987654321]
    counters = [0, 1, 7, 31, 1000, 5]
    got = counter_uniforms(torch.tensor(seeds), torch.tensor(counters))
    expected = [(_splitmix64(s, c) >> 11) * 2.0**-53 for s, c in zip(seeds, counters)]
    assert got.dtype == torch.float64
    assert got.tolist() == expected
    assert got.min() >= 0 and got.max() < 1


def test_counter_uniforms_are_uniform_and_decorrelated():
    seeds = torch.arange(20000)
    first, second = counter_uniforms(seeds, torch.zeros_like(seeds)), counter_uniforms(seeds, torch.ones_like(seeds))
    for u in (first, second):
        counts = torch.histc(u.float(), bins=10, min=0, max=1)
        assert (counts - 2000).abs().max() < 5 * math.sqrt(2000 * 0.9)
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1]) < 0.03


@pytest.mark.parametrize(("top_k", "top_p"), [(-1, 1.0), (4, 1.0), (-1, 0.8)])
def test_seeded_draws_reproduce_and_differ_across_seeds(top_k, top_p):
    logits = LOGITS.expand(64, -1)

    def draw(seed: int) -> list[int]:
        uniforms = counter_uniforms(torch.arange(64) + seed * 100, torch.zeros(64, dtype=torch.long))
        return sample_next_tokens(logits, temperature=1.0, top_k=top_k, top_p=top_p, uniforms=uniforms)[0].tolist()

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_untruncated_path_picks_the_token_whose_cdf_interval_holds_u():
    logits = torch.tensor([[0.0, -200.0, 1.0, -1000.0]]).expand(6, -1)  # token 3 has exactly zero mass
    probs = torch.softmax(logits[0].double(), -1)
    cdf = probs.cumsum(-1)
    uniforms = torch.tensor([0.0, float(cdf[0]) * 0.999, float(cdf[0]) * 1.001, 0.5, 1 - 1e-16, 0.9999999999999999])
    tokens, _ = sample_next_tokens(logits, temperature=1.0, top_k=-1, top_p=1.0, uniforms=uniforms)
    assert tokens.tolist() == [0, 0, 2, 2, 2, 2]
