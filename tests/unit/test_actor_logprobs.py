"""Chunked log-prob/entropy against a float64 reference: values and both gradients."""

import pytest
import torch

from megatron_dapo.actor.logprobs import log_probs_and_entropy, log_probs_from_logits


def _reference(logits: torch.Tensor, target: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    return log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_float64(chunk_size: int, temperature: float) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(50, 97, generator=gen) * 4).requires_grad_(True)
    target = torch.randint(0, 97, (50,), generator=gen)
    w_lp, w_h = torch.randn(50, generator=gen), torch.randn(50, generator=gen)

    lp, h = log_probs_and_entropy(logits, target, temperature=temperature, chunk_size=chunk_size)
    ((lp * w_lp).sum() + (h * w_h).sum()).backward()

    ref_logits = logits.detach().double().requires_grad_(True)
    ref_lp, ref_h = _reference(ref_logits, target, temperature)
    ((ref_lp * w_lp.double()).sum() + (ref_h * w_h.double()).sum()).backward()

    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(h.double(), ref_h.detach(), rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("which", ["log_prob", "entropy"])
def test_gradient_of_one_output_alone(which: str) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 33, generator=gen).requires_grad_(True)
    target = torch.randint(0, 33, (20,), generator=gen)
    lp, h = log_probs_and_entropy(logits, target, chunk_size=6)
    (lp if which == "log_prob" else h).sum().backward()

    ref_logits = logits.detach().double().requires_grad_(True)
    ref_lp, ref_h = _reference(ref_logits, target, 1.0)
    (ref_lp if which == "log_prob" else ref_h).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-6, atol=2e-6)


def test_bf16_logits_get_bf16_gradient_close_to_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(16, 40, generator=gen) * 3).bfloat16().requires_grad_(True)
    target = torch.randint(0, 40, (16,), generator=gen)
    lp, _ = log_probs_and_entropy(logits, target, chunk_size=5)
    lp.sum().backward()
    ref_logits = logits.detach().double().requires_grad_(True)
    ref_lp, _ = _reference(ref_logits, target, 1.0)
    ref_lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    # The logits are exactly representable in fp32, so only the fp32 math adds error.
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=0, atol=8e-3)


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(9, 11).requires_grad_(True)
    before = logits.detach().clone()
    lp, h = log_probs_and_entropy(logits, torch.arange(9), temperature=0.5, chunk_size=4)
    (lp.sum() + h.sum()).backward()
    assert torch.equal(logits.detach(), before)


def test_cpu_log_probs_from_logits_uses_chunked_path() -> None:
    logits = torch.randn(12, 30, generator=torch.Generator().manual_seed(3))
    target = torch.arange(12)
    got = log_probs_from_logits(logits, target, temperature=0.9, chunk_size=5)
    ref, _ = _reference(logits, target, 0.9)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": 0.0}, "temperature=0.0 must be > 0"),
    ({"chunk_size": 0}, "chunk_size=0 must be > 0"),
])
def test_bad_arguments_name_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        log_probs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), **kwargs)


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"expected logits \[T, V/tp\] and target \[T\], got \(2, 3, 4\)"):
        log_probs_and_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))


def test_vocabulary_padding_columns_are_excluded() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(10, 48, generator=gen) * 2).requires_grad_(True)  # 40 real + 8 padding columns
    target = torch.randint(0, 40, (10,), generator=gen)
    lp, h = log_probs_and_entropy(logits, target, chunk_size=3, vocab_size=40)
    (lp.sum() + h.sum()).backward()
    ref_logits = logits.detach()[:, :40].double().requires_grad_(True)
    ref_lp, ref_h = _reference(ref_logits, target, 1.0)
    (ref_lp.sum() + ref_h.sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(h.double(), ref_h.detach(), rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(logits.grad[:, :40].double(), ref_logits.grad, rtol=1e-6, atol=2e-6)
    assert torch.count_nonzero(logits.grad[:, 40:]) == 0
