"""gather_over_cp on real process groups (gloo, 2 and 3 ranks): forward order and the backward share.

Every CP rank holds its load-balanced positions of x; after the gather every rank has x in
sequence order; the gradient each rank receives is the whole loss's gradient at its own
positions only, so the CP ranks' gradients sum to the unsplit gradient (not cp times it).
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed

pytestmark = pytest.mark.multirank

SEQ_LEN = 12


def _worker(cp: int) -> dict:
    import torch.distributed as dist

    from megatron_dapo import parallel
    from megatron_dapo.actor.context_parallel import cp_positions, gather_over_cp, split_sequence

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    group = dist.new_group(list(range(cp)))
    rank = dist.get_rank(group)
    full = torch.arange(2.0 * SEQ_LEN).view(2, SEQ_LEN) / 10
    local = split_sequence(full, cp_positions(SEQ_LEN, cp, rank)).requires_grad_()
    gathered = gather_over_cp(local, group, cp)
    weights = torch.linspace(-1.0, 2.0, 2 * SEQ_LEN).view(2, SEQ_LEN)
    (gathered.square() * weights).sum().backward()
    return {"gathered": gathered.detach(), "grad": local.grad, "positions": cp_positions(SEQ_LEN, cp, rank)}


@pytest.mark.parametrize("cp", [2, 3])
def test_gather_restores_order_and_backward_keeps_the_own_share(cp: int) -> None:
    outs = run_distributed(_worker, cp, cp)
    full = torch.arange(2.0 * SEQ_LEN).view(2, SEQ_LEN) / 10
    weights = torch.linspace(-1.0, 2.0, 2 * SEQ_LEN).view(2, SEQ_LEN)
    whole_grad = 2 * full * weights
    summed = torch.zeros_like(full)
    for r in outs:
        assert torch.equal(r["gathered"], full)
        assert torch.allclose(r["grad"], whole_grad[:, r["positions"]])
        summed[:, r["positions"]] += r["grad"]
    assert torch.allclose(summed, whole_grad)
