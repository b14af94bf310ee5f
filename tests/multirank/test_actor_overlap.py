"""Overlapped gradient reduction (the GPU default with DP > 1) gives the same updates as the
synchronous one, with several micro-batches per rank, at DP 4 and at PP 2 x DP 2 (gloo)."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank


def _worker(directory: str) -> dict:
    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.models import adapter_for

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    out = {}
    for tp, pp in ((1, 1), (1, 2)):
        dims = parallel.initialize_model_parallel(tp, pp, seed=0)
        adapter = adapter_for(directory)
        g = torch.Generator().manual_seed(10 + dims.dp_rank)
        lengths = [12, 9, 7, 11]
        ids = torch.randint(3, 60, (4, 12), generator=g)
        mask = torch.zeros(4, 12, dtype=torch.bool)
        for i, n in enumerate(lengths):
            mask[i, 4:n] = True
        adv = torch.randn(4, 1, generator=g).expand(4, 12) * mask
        weights = {}
        for overlap in (False, True):
            config = make_optimizer_config(OptimConfig(lr=1e-2, clip_grad=0.0), dtype=torch.float32,
                                           use_distributed_optimizer=True)
            actor = MegatronActor(adapter=adapter, dims=dims, optimizer_config=config, hf_checkpoint=directory,
                                  max_tokens_per_microbatch=24, overlap_grad_reduce=overlap)
            batch = RolloutBatch(input_ids=ids, seq_lens=torch.tensor(lengths), response_mask=mask,
                                 advantages=adv.contiguous())
            batch.old_log_probs, _ = actor.compute_log_probs(batch, 1.0)
            batch.old_log_probs = batch.old_log_probs - 0.05  # ratio != 1: a real gradient
            # megatron-core counts each bucket's gradients on the first step and overlaps from
            # the second on: three steps exercise the overlapped path twice.
            for _ in range(3):
                metrics = actor.train_step(batch, LossSettings())
            weights[overlap] = ({n: t.clone() for n, t in adapter.export_hf(actor.model, dims)}, metrics,
                                len(actor._microbatches(batch)))
        off, on = weights[False], weights[True]
        out[f"pp{pp}"] = {"max_diff": max(float((off[0][n] - on[0][n]).abs().max()) for n in off[0]),
                          "moved": max(float((off[0][n] - t).abs().max()) for n, t in adapter.export_hf(
                              MegatronActor(adapter=adapter, dims=dims, hf_checkpoint=directory,
                                            optimizer_config=make_optimizer_config(
                                                OptimConfig(lr=1e-2), dtype=torch.float32,
                                                use_distributed_optimizer=True)).model, dims)),
                          "grad_norms": (off[1]["actor/grad_norm"], on[1]["actor/grad_norm"]),
                          "num_microbatches": off[2]}
    return out


def test_overlapped_grad_reduce_matches_the_synchronous_update(tmp_path):
    directory = make_tiny_checkpoint(tmp_path / "hf", num_layers=2)
    results = run_distributed(_worker, 4, str(directory), timeout_s=300)
    for layout in ("pp1", "pp2"):
        r = results[0][layout]
        assert r["num_microbatches"] >= 2
        assert r["moved"] > 1e-4  # the step changed the weights
        assert r["max_diff"] < 1e-6
        assert r["grad_norms"][0] == pytest.approx(r["grad_norms"][1], rel=1e-6)
