"""The planner's LoRA terms (plan/lora.py) against the adapters the actor really builds, and the
32B LoRA recipe (examples/dapo_qwen2.5_32b_lora.yaml) fitting where the full recipe cannot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_dapo.config.loader import load_config
from megatron_dapo.plan import GPUS, make_plan, resolve_model
from megatron_dapo.plan.dims import ModelDims
from megatron_dapo.plan.lora import lora_params_per_gpu, lora_sync_bytes

REPO = Path(__file__).resolve().parents[2]
H100 = GPUS["h100"]


def _count_worker(directory: str, targets: tuple[str, ...]) -> int:
    from megatron_dapo import parallel
    from megatron_dapo.lora import apply_lora
    from megatron_dapo.models import adapter_for

    parallel.init_distributed("cpu")
    dims = parallel.initialize_model_parallel(1, 1, seed=0)
    adapter = adapter_for(directory)
    model = adapter.build_model(dims, dtype=torch.float32, init_weights=False)
    return apply_lora(model, rank=3, alpha=6.0, dropout=0.0, targets=targets, seed=0).num_params()


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_the_planners_adapter_count_is_the_actors(tmp_path, family):
    from dist_utils import run_distributed
    from model_utils import make_tiny_checkpoint

    directory = make_tiny_checkpoint(tmp_path / family, family, num_layers=2, seed=1)
    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts")
    real = run_distributed(_count_worker, 1, str(directory), targets)[0]
    dims = ModelDims.from_hf(json.loads((directory / "config.json").read_text()), family, str(directory))
    assert lora_params_per_gpu(dims, rank=3, targets=targets, tp=1, pp=1, ep=1) == real
    assert lora_sync_bytes(dims, rank=3, targets=targets) == 2 * real


def test_the_32b_lora_recipe_fits_one_node_where_the_full_recipe_fits_none():
    def plan(path: str, *overrides: str):
        cfg = load_config(str(REPO / "examples" / path), [*overrides, "trainer.nnodes=1"])
        return make_plan(cfg, resolve_model(cfg), nodes=1, gpus_per_node=8, hardware=H100)

    lora = plan("dapo_qwen2.5_32b_lora.yaml")
    assert lora.fits and (lora.tp, lora.pp, lora.dp) == (8, 1, 1) and lora.lora_rank == 64
    # The base in bf16 alone; 4.1 B local params at 18 B each would be 69 GiB.
    assert lora.model_state_bytes < 0.2 * lora.params_per_gpu * 18
    full = plan("dapo_qwen2.5_32b.yaml", "parallel.pipeline_model_parallel_size=1")
    assert not full.fits
    assert lora.lora_sync_bytes < 0.03 * lora.rollout_weight_bytes * lora.rollout_tp
