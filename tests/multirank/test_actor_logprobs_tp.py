"""Vocab-parallel log-probs and entropy under TP=2 (gloo): values and gradients of each slice."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

pytestmark = pytest.mark.multirank


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 64, generator=gen) * 5  # [T, V]
    target = torch.randint(0, 64, (37,), generator=gen)
    return logits, target, torch.randn(37, generator=gen), torch.randn(37, generator=gen)


def _tp_worker(temperature: float, chunk_size: int) -> dict[str, torch.Tensor]:
    from megatron_dapo import parallel
    from megatron_dapo.actor.logprobs import log_probs_and_entropy

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    rank, size = dist.get_rank(), dist.get_world_size()
    logits, target, w_lp, w_h = _inputs()
    vocab_local = logits.shape[1] // size
    local = logits[:, rank * vocab_local:(rank + 1) * vocab_local].clone().requires_grad_(True)
    lp, h = log_probs_and_entropy(local, target, temperature=temperature, tp_group=dist.group.WORLD,
                                  chunk_size=chunk_size)
    ((lp * w_lp).sum() + (h * w_h).sum()).backward()
    return {"log_prob": lp.detach(), "entropy": h.detach(), "grad": local.grad}


def test_tp2_matches_float64_reference() -> None:
    temperature = 0.8
    results = run_distributed(_tp_worker, 2, temperature, 10)
    logits, target, w_lp, w_h = _inputs()
    ref = logits.double().requires_grad_(True)
    log_p = torch.log_softmax(ref / temperature, dim=-1)
    ref_lp = log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ref_h = -(log_p.exp() * log_p).sum(-1)
    ((ref_lp * w_lp.double()).sum() + (ref_h * w_h.double()).sum()).backward()

    for r in results:  # every TP rank holds the full per-token values
        torch.testing.assert_close(r["log_prob"].double(), ref_lp.detach(), rtol=1e-6, atol=2e-6)
        torch.testing.assert_close(r["entropy"].double(), ref_h.detach(), rtol=1e-6, atol=2e-6)
    grad = torch.cat([r["grad"] for r in results], dim=1)  # each rank's vocab slice, side by side
    torch.testing.assert_close(grad.double(), ref.grad, rtol=1e-6, atol=2e-6)
    assert float(ref_lp.detach().abs().max()) > 1.0  # the targets are not trivially likely
