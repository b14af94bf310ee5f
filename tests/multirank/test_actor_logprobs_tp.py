"""Vocab-parallel log-probs and entropy under TP=2 (gloo): values and gradients of each slice.

Three vocabularies over the same 64 logit columns (32 per rank): all real, 40 real (rank 1
holds 8 real columns and 24 of Megatron's padding) and 30 real (rank 1 holds only padding).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

pytestmark = pytest.mark.multirank

TEMPERATURE = 0.8
VOCAB_SIZES = (64, 40, 30)


def _inputs(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 64, generator=gen) * 5  # [T, V padded]
    target = torch.randint(0, vocab_size, (37,), generator=gen)
    return logits, target, torch.randn(37, generator=gen), torch.randn(37, generator=gen)


def _tp_worker() -> dict[int, dict[str, torch.Tensor]]:
    from megatron_dapo import parallel
    from megatron_dapo.actor.logprobs import log_probs_and_entropy

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    rank, size = dist.get_rank(), dist.get_world_size()
    out = {}
    for vocab_size in VOCAB_SIZES:
        logits, target, w_lp, w_h = _inputs(vocab_size)
        vocab_local = logits.shape[1] // size
        local = logits[:, rank * vocab_local:(rank + 1) * vocab_local].clone().requires_grad_(True)
        lp, h = log_probs_and_entropy(local, target, temperature=TEMPERATURE, tp_group=dist.group.WORLD,
                                      chunk_size=10, vocab_size=vocab_size)
        ((lp * w_lp).sum() + (h * w_h).sum()).backward()
        out[vocab_size] = {"log_prob": lp.detach(), "entropy": h.detach(), "grad": local.grad}
    return out


def test_tp2_matches_float64_reference() -> None:
    results = run_distributed(_tp_worker, 2)
    for vocab_size in VOCAB_SIZES:
        logits, target, w_lp, w_h = _inputs(vocab_size)
        ref = logits[:, :vocab_size].double().requires_grad_(True)
        log_p = torch.log_softmax(ref / TEMPERATURE, dim=-1)
        ref_lp = log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        ref_h = -(log_p.exp() * log_p).sum(-1)
        ((ref_lp * w_lp.double()).sum() + (ref_h * w_h.double()).sum()).backward()

        for r in results:  # every TP rank holds the full per-token values
            torch.testing.assert_close(r[vocab_size]["log_prob"].double(), ref_lp.detach(), rtol=1e-6, atol=2e-6)
            torch.testing.assert_close(r[vocab_size]["entropy"].double(), ref_h.detach(), rtol=1e-6, atol=2e-6)
        grad = torch.cat([r[vocab_size]["grad"] for r in results], dim=1)  # the slices side by side
        torch.testing.assert_close(grad[:, :vocab_size].double(), ref.grad, rtol=1e-6, atol=2e-6)
        assert torch.count_nonzero(grad[:, vocab_size:]) == 0
        assert float(ref_lp.detach().abs().max()) > 1.0  # the targets are not trivially likely
