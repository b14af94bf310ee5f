"""Context parallelism on real CP attention: CP 2 equals CP 1 (log-probs and one SGD step).

Needs two CUDA GPUs and Transformer Engine (megatron-core's CP attention is TE's); skipped
elsewhere with the reason. The same tiny checkpoint and batch (odd lengths, so every
sequence is padded to a multiple of 2 x CP) go through the actor at world 2 as DP 2 x CP 1
and as DP 1 x CP 2. Log-probs must agree, and one plain SGD step (which reads the gradient
itself) must move the weights the same: with the schedule's x cp left uncorrected the CP
run's update would be twice as large.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallelism needs >= 2 CUDA GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                       reason="context parallel attention needs transformer_engine"),
]

LENGTHS = [21, 17, 15, 9]
PROMPT_LENGTHS = [5, 4, 6, 3]
SGD_LR = 1e4


def _worker(cp: int, directory: str) -> dict:
    from megatron.core.optimizer import OptimizerConfig

    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.microbatch import RolloutBatch
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.models import adapter_for

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    dims = parallel.initialize_model_parallel(1, 1, cp, seed=0)
    adapter = adapter_for(directory)
    gen = torch.Generator().manual_seed(4)
    width = max(LENGTHS)
    pos = torch.arange(width)
    lens = torch.tensor(LENGTHS)
    ids = torch.where(pos < lens.unsqueeze(1), torch.randint(0, 100, (len(LENGTHS), width), generator=gen), 0)
    response = (pos >= torch.tensor(PROMPT_LENGTHS).unsqueeze(1)) & (pos < lens.unsqueeze(1))
    adv = torch.randn(len(LENGTHS), generator=gen).unsqueeze(1).expand(-1, width).contiguous()
    # DP 2 gives each rank half the batch; CP 2 gives both ranks all of it.
    rows = list(range(len(LENGTHS))) if cp == 2 else [dims.dp_rank, dims.dp_rank + 2]
    batch = RolloutBatch(input_ids=ids[rows], seq_lens=lens[rows], response_mask=response[rows],
                         advantages=adv[rows])
    sgd = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=SGD_LR, min_lr=SGD_LR, weight_decay=0.0,
                          clip_grad=0.0, params_dtype=torch.float32, use_distributed_optimizer=False)
    actor = MegatronActor(adapter=adapter, dims=dims, optimizer_config=sgd, hf_checkpoint=directory,
                          max_tokens_per_microbatch=64, packed=False)
    log_probs, _ = actor.compute_log_probs(batch, 1.0)
    actor.train_step(batch, LossSettings(), old_from_forward=True)
    weights = {n: t.cpu() for n, t in adapter.export_hf(actor.model, dims)}
    return {"rows": rows, "log_probs": log_probs.cpu(), "weights": weights}


def test_cp2_equals_cp1(tmp_path) -> None:
    directory = str(make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", num_layers=2, seed=5))
    dp_runs = run_distributed(_worker, 2, 1, directory, device_kind="cuda", timeout_s=600)
    cp_runs = run_distributed(_worker, 2, 2, directory, device_kind="cuda", timeout_s=600)
    reference = torch.zeros(len(LENGTHS), max(LENGTHS))
    for r in dp_runs:
        reference[r["rows"], : r["log_probs"].shape[1]] = r["log_probs"]
    for r in cp_runs:
        assert torch.allclose(r["log_probs"], reference, atol=1e-4), float((r["log_probs"] - reference).abs().max())
    for name, w in dp_runs[0]["weights"].items():
        rel = float((cp_runs[0]["weights"][name] - w).norm() / w.norm())
        assert rel < 1e-4, (name, rel)
