"""The fused Triton log-prob/entropy kernels against float64 and against the chunked torch path.

GPU tier: needs CUDA and triton. bf16 logits, temperatures 1.0 and 0.7, Megatron vocabulary
padding columns, gradients of both outputs at once; fresh random inputs every case.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton", reason="triton is not installed")

from megatron_dapo.actor.logprobs import _ChunkedLogProbEntropy, log_probs_and_entropy  # noqa: E402
from megatron_dapo.actor.triton_logprobs import triton_log_probs_and_entropy  # noqa: E402


def _reference(logits: torch.Tensor, target: torch.Tensor, temperature: float, num_real: int):
    logp = torch.log_softmax(logits[:, :num_real].double() / temperature, dim=-1)
    return logp.gather(-1, target[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("num_tokens", "num_cols", "vocab_size"), [(300, 5000, 5000), (257, 8320, 8200), (64, 151936, 151936)])
def test_triton_matches_float64_forward_and_backward(temperature, num_tokens, num_cols, vocab_size):
    torch.manual_seed(num_tokens + num_cols)
    logits = (torch.randn(num_tokens, num_cols, device="cuda") * 4).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, vocab_size, (num_tokens,), device="cuda")
    g_lp, g_h = torch.randn(num_tokens, device="cuda"), torch.randn(num_tokens, device="cuda")
    lp, ent = triton_log_probs_and_entropy(logits, target, temperature=temperature, vocab_size=vocab_size)
    (g_lp * lp + g_h * ent).sum().backward()

    ref_x = logits.detach().double().requires_grad_(True)
    ref_lp, ref_ent = _reference(ref_x, target, temperature, vocab_size)
    (g_lp.double() * ref_lp + g_h.double() * ref_ent).sum().backward()
    assert not torch.isnan(lp).any() and not torch.isnan(logits.grad).any()
    assert _rel(lp, ref_lp) < 1e-5
    assert _rel(ent, ref_ent) < 1e-5
    assert _rel(logits.grad, ref_x.grad) < 1e-2  # the gradient is stored in bf16
    # Padding columns take no part in the softmax.
    assert float(logits.grad[:, vocab_size:].abs().sum()) == 0.0


def test_triton_agrees_with_the_chunked_path_and_is_the_cuda_default():
    torch.manual_seed(1)
    logits = torch.randn(500, 12000, device="cuda").to(torch.bfloat16)
    target = torch.randint(0, 12000, (500,), device="cuda")
    fused = log_probs_and_entropy(logits, target, temperature=0.6)
    chunked = _ChunkedLogProbEntropy.apply(logits, target, 0.6, 128, None, None)
    for a, b in zip(fused, chunked, strict=True):
        assert float((a - b).abs().max()) < 1e-4


def test_on_policy_ratio_is_one_with_bf16_logits_at_any_temperature():
    """Old log-probs (no grad) and the update's log-probs (with grad) agree exactly: ratio 1."""
    torch.manual_seed(2)
    logits = torch.randn(256, 9000, device="cuda").to(torch.bfloat16)
    target = torch.randint(0, 9000, (256,), device="cuda")
    for temperature in (0.6, 1.0):
        with torch.no_grad():
            old, _ = log_probs_and_entropy(logits, target, temperature=temperature)
        new, _ = log_probs_and_entropy(logits.clone().requires_grad_(True), target, temperature=temperature)
        assert torch.equal(torch.exp(new.detach() - old), torch.ones_like(old))
