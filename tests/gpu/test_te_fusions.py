"""Kernel fusions of the Transformer Engine spec change speed, not results.

Needs one CUDA GPU and Transformer Engine; skipped elsewhere with the reason. The same tiny
fp32 checkpoint and batch go through the actor with the fusions models/transformer_impl.kernel_fusions
picks (TE's fused RoPE always; megatron's torch.compile'd SwiGLU and bias-dropout-add with
triton; apex's fused wgrad accumulation with apex) and with all of them off: log-probs
and the weights after one plain SGD step (which reads the gradient itself) must agree.
Not yet run on a GPU with TE (none was lent with it): the H100 run of 2026-11-22 had no TE.
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
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                       reason="the fusions are only used with transformer_engine"),
]

LENGTHS = [21, 17, 15, 9]
PROMPT_LENGTHS = [5, 4, 6, 3]
SGD_LR = 1e4


def _worker(fused: bool, directory: str) -> dict:
    from megatron.core.optimizer import OptimizerConfig

    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.microbatch import RolloutBatch
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.models import adapter as adapter_module
    from megatron_dapo.models import adapter_for, unwrap_model
    from megatron_dapo.models.transformer_impl import FUSION_FLAGS

    if not fused:  # this spawned process only: the reference without any fusion
        # build_model looks kernel_fusions up in adapter.py, which imports the name: patch it there.
        adapter_module.kernel_fusions = lambda **_: dict.fromkeys(FUSION_FLAGS, False)
    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    dims = parallel.initialize_model_parallel(1, 1, seed=0)
    adapter = adapter_for(directory)
    gen = torch.Generator().manual_seed(4)
    width = max(LENGTHS)
    pos = torch.arange(width)
    lens = torch.tensor(LENGTHS)
    ids = torch.where(pos < lens.unsqueeze(1), torch.randint(0, 100, (len(LENGTHS), width), generator=gen), 0)
    response = (pos >= torch.tensor(PROMPT_LENGTHS).unsqueeze(1)) & (pos < lens.unsqueeze(1))
    adv = torch.randn(len(LENGTHS), generator=gen).unsqueeze(1).expand(-1, width).contiguous()
    batch = RolloutBatch(input_ids=ids, seq_lens=lens, response_mask=response, advantages=adv)
    sgd = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=SGD_LR, min_lr=SGD_LR, weight_decay=0.0,
                          clip_grad=0.0, params_dtype=torch.float32, use_distributed_optimizer=False)
    actor = MegatronActor(adapter=adapter, dims=dims, optimizer_config=sgd, hf_checkpoint=directory,
                          max_tokens_per_microbatch=64)
    config = unwrap_model(actor.model).config
    log_probs, _ = actor.compute_log_probs(batch, 1.0)
    actor.train_step(batch, LossSettings(), old_from_forward=True)
    weights = {n: t.cpu() for n, t in adapter.export_hf(actor.model, dims)}
    return {"fusions": {f: getattr(config, f) for f in FUSION_FLAGS}, "log_probs": log_probs.cpu(),
            "weights": weights}


def test_fused_te_model_equals_unfused(tmp_path) -> None:
    from megatron_dapo.models.transformer_impl import kernel_fusions

    directory = str(make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", num_layers=2, seed=6))
    (fused,) = run_distributed(_worker, 1, True, directory, device_kind="cuda", timeout_s=600)
    (plain,) = run_distributed(_worker, 1, False, directory, device_kind="cuda", timeout_s=600)
    assert fused["fusions"] == kernel_fusions(
        use_te=True, apex_wgrad=importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
        triton=importlib.util.find_spec("triton") is not None)
    assert fused["fusions"]["apply_rope_fusion"] and not any(plain["fusions"].values())
    err = float((fused["log_probs"] - plain["log_probs"]).abs().max())
    assert err < 1e-4, err
    for name, w in plain["weights"].items():
        rel = float((fused["weights"][name] - w).norm() / w.norm())
        assert rel < 1e-4, (name, rel)
