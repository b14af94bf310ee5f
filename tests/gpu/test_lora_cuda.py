"""LoRA on a CUDA actor in bf16 (issue 62): the adapters live on the GPU in the model dtype, the base
is unchanged by an update, the adapters-off reference is the base, and the merged export is W +
(alpha/r) B A merged in float32 and cast to bf16. The CPU tests hold the same in float32 over
gloo (tests/multirank/test_actor_lora.py); this one holds what differs on a GPU: device placement,
bf16 with fp32 main grads, the distributed optimizer's fp32 shards. Not yet run on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _worker(directory: str) -> dict:
    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch
    from megatron_dapo.actor.reference import BaseOfAdapters
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import LoraConfig, OptimConfig
    from megatron_dapo.models import adapter_for, unwrap_model

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    dims = parallel.initialize_model_parallel(1, 1, seed=0)
    adapter = adapter_for(directory)
    optim = make_optimizer_config(OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0), dtype=torch.bfloat16,
                                  use_distributed_optimizer=True)
    actor = MegatronActor(adapter=adapter, dims=dims, optimizer_config=optim, hf_checkpoint=directory,
                          lora=LoraConfig(rank=4, alpha=8.0), seed=1, use_te=False, packed=False)
    gpt = unwrap_model(actor.model)
    lora = actor.lora
    devices = {p.device.type for _, p in lora.params()}
    dtypes = {p.dtype for _, p in lora.params()}
    base = {n: p.detach().clone() for n, p in gpt.named_parameters() if not n.endswith(("lora_A", "lora_B"))}
    gen = torch.Generator().manual_seed(3)
    lens = torch.tensor([19, 14, 11])
    ids = torch.randint(0, 100, (3, 19), generator=gen) * (torch.arange(19) < lens.unsqueeze(1))
    mask = (torch.arange(19) >= 4) & (torch.arange(19) < lens.unsqueeze(1))
    adv = torch.tensor([1.0, -1.0, 0.5]).unsqueeze(1).expand(-1, 19).contiguous()

    def batch() -> RolloutBatch:
        return RolloutBatch(input_ids=ids, seq_lens=lens, response_mask=mask, advantages=adv)

    start, _ = actor.compute_log_probs(batch(), 1.0)
    for _ in range(2):
        actor.train_step(batch(), LossSettings(temperature=1.0), old_from_forward=True)
    after, _ = actor.compute_log_probs(batch(), 1.0)
    reference = BaseOfAdapters(actor).compute_log_probs(batch(), 1.0)
    base_kept = all(torch.equal(p, base[n]) for n, p in gpt.named_parameters() if n in base)
    (site,) = [s for s in lora.sites if s.global_path == "decoder.layers.0.self_attention.linear_qkv"]
    by_hand = (site.module.weight.float() + lora.scale * (site.b_matrix().float() @ site.module.lora_A.float()))
    merged = dict(adapter.export_hf(actor.model, dims))["model.layers.0.self_attn.q_proj.weight"]
    return {"devices": devices, "dtypes": dtypes, "base_kept": base_kept, "moved": float((after - start).abs().max()),
            "reference_gap": float((reference - start).abs().max()),
            "merged_ok": bool(torch.equal(merged.cpu(), adapter_q_rows(by_hand.to(torch.bfloat16), adapter).cpu()))}


def adapter_q_rows(qkv: torch.Tensor, adapter) -> torch.Tensor:
    """The q_proj rows of a TP 1 linear_qkv weight (megatron's per-query-group [q, k, v] layout)."""
    from megatron_dapo.models import mapping

    tm = mapping.TensorMap(mcore_name="", hf_names=("q", "k", "v"), kind="qkv", sort_key=(0,))
    return mapping.hf_from_shards(tm, [qkv], adapter.hf)[0]


def test_a_bf16_lora_actor_on_cuda_trains_adapters_only(tmp_path):
    directory = str(make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", num_layers=2, seed=2, dtype=torch.bfloat16))
    (r,) = run_distributed(_worker, 1, directory, device_kind="cuda", timeout_s=600)
    assert r["devices"] == {"cuda"} and r["dtypes"] == {torch.bfloat16}
    assert r["base_kept"] and r["moved"] > 1e-3
    assert r["reference_gap"] == 0.0  # the base with adapters off, bitwise
    assert r["merged_ok"]
