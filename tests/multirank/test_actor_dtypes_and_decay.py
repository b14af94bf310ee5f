"""The actor's parameter dtype and weight-decay rules, on one real megatron-core rank.

- A bf16 actor holds every parameter in bf16 (torch's RMSNorm fallback creates fp32 norm
  weights, with which the distributed optimizer paired the wrong tensors and the first
  checkpoint save of a bf16 run failed); its checkpoint saves and loads back.
- AdamW decays only the parameters megatron-core gives wd_mult=1: with a zero gradient the
  Adam update is 0, so matrices shrink by exactly (1 - lr x wd) and norms and biases keep
  their values.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank


def _batch():
    from megatron_dapo.actor.microbatch import RolloutBatch

    ids = torch.arange(24).reshape(2, 12) % 50 + 3
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[:, 6:] = True
    return RolloutBatch(input_ids=ids, seq_lens=torch.tensor([12, 12]), response_mask=mask,
                        advantages=torch.zeros(2, 12))


def _worker(directory: str, out_dir: str) -> dict:
    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.checkpoint import CheckpointManager
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.models import adapter_for

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    dims = parallel.initialize_model_parallel(1, 1, seed=0)
    adapter = adapter_for(directory)
    out: dict = {}

    def actor(dtype: torch.dtype, lr: float, wd: float) -> MegatronActor:
        config = make_optimizer_config(OptimConfig(lr=lr, weight_decay=wd, clip_grad=0.0), dtype=dtype,
                                       use_distributed_optimizer=True)
        return MegatronActor(adapter=adapter, dims=dims, optimizer_config=config, hf_checkpoint=directory)

    bf16 = actor(torch.bfloat16, 1e-3, 0.1)
    out["bf16_dtypes"] = sorted({str(p.dtype) for p in bf16.model.parameters()})
    batch = _batch()
    batch.old_log_probs, _ = bf16.compute_log_probs(batch, 1.0)
    bf16.train_step(batch, LossSettings())
    manager = CheckpointManager(out_dir)
    manager.save(1, [bf16.model], bf16.optimizer, bf16.scheduler, trainer_state={"step": 1}, config_dict={},
                 hf_dir=directory)
    before = {n: p.detach().clone() for n, p in bf16.model.named_parameters()}
    again = actor(torch.bfloat16, 1e-3, 0.1)
    out["loaded_step"] = manager.load(manager.root / "step_1", [again.model], again.optimizer, again.scheduler)["step"]
    out["bf16_roundtrip"] = all(torch.equal(before[n], p) for n, p in again.model.named_parameters())

    lr, wd = 0.1, 0.5
    fp32 = actor(torch.float32, lr, wd)
    start = {n: p.detach().clone() for n, p in fp32.model.named_parameters()}
    batch = _batch()
    batch.old_log_probs, _ = fp32.compute_log_probs(batch, 1.0)
    fp32.train_step(batch, LossSettings())  # advantages 0: zero gradient, zero Adam update
    out["decay"] = {n: float((p.detach() / start[n])[start[n] != 0].mean()) for n, p in fp32.model.named_parameters()}
    out["factor"] = 1 - lr * wd
    return out


def test_bf16_params_checkpoint_and_weight_decay_masks(tmp_path):
    directory = make_tiny_checkpoint(tmp_path / "hf", num_layers=2)
    (result,) = run_distributed(_worker, 1, str(directory), str(tmp_path / "ckpt"))
    assert result["bf16_dtypes"] == ["torch.bfloat16"]
    assert result["loaded_step"] == 1 and result["bf16_roundtrip"]
    decayed = {n: r for n, r in result["decay"].items() if r != pytest.approx(1.0, abs=1e-6)}
    kept = {n for n in result["decay"] if n not in decayed}
    assert decayed and all(r == pytest.approx(result["factor"], rel=1e-5) for r in decayed.values())
    # Norms and biases are 1-D: exactly the ones that keep their values.
    assert kept == {n for n in result["decay"] if "norm" in n or "bias" in n or "layer_norm_weight" in n}
    assert all(len(n) for n in kept) and any("norm" in n for n in kept)
