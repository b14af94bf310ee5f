"""The scratch model of the embedded run: dense Qwen2 (the default) or Qwen3-MoE (tiny_moe_cpu)."""

from __future__ import annotations

from megatron_dapo.config.model import ScratchModelConfig
from megatron_dapo.embedded import scratch_checkpoint
from megatron_dapo.models import adapter_for


def test_a_qwen3_moe_scratch_model_is_what_the_moe_adapter_reads(tmp_path):
    scratch = ScratchModelConfig(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0])
    path = scratch_checkpoint(scratch, 512, 0, tmp_path)
    hf = adapter_for(path).hf
    assert (hf.family, hf.num_experts, hf.num_experts_per_tok, hf.norm_topk_prob) == ("qwen3_moe", 8, 2, True)
    assert hf.moe_layers == (1, 2, 3) and hf.qk_norm
    assert hf.moe_intermediate_size == 384 // 2  # the dense MLP's width, spread over the active experts
    # Cached by its settings; the dense default is another checkpoint.
    assert scratch_checkpoint(scratch, 512, 0, tmp_path) == path
    dense = scratch_checkpoint(ScratchModelConfig(), 512, 0, tmp_path)
    assert dense != path and adapter_for(dense).hf.family == "qwen2"
