"""Qwen3 / Qwen3-MoE config parsing, the MoE TransformerConfig fields, and the megatron-core 0.16.1 facts they rest on."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_dapo.errors import UserError
from megatron_dapo.models import adapter_for, mapping
from megatron_dapo.models.moe import ensure_router_fallback, moe_config_kwargs

QWEN3_30B_A3B = {  # the fields of Qwen/Qwen3-30B-A3B's config.json that the adapter reads
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False, "use_sliding_window": False,
}


def test_qwen3_30b_a3b_config_and_its_hf_tensors() -> None:
    hf = adapter_for(dict(QWEN3_30B_A3B)).hf
    assert (hf.family, hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size) == ("qwen3_moe", 128, 8, 768)
    assert hf.qk_norm and hf.norm_topk_prob and hf.moe_layers == tuple(range(48))
    shapes = mapping.expected_hf_shapes(hf)
    assert shapes["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert shapes["model.layers.0.mlp.gate.weight"] == (128, 2048)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert "model.layers.0.mlp.gate_proj.weight" not in shapes
    # 48 layers x (4 norms/attention x ... ): 3 x 128 expert tensors + router per layer.
    assert sum(".mlp.experts." in n for n in shapes) == 48 * 128 * 3
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 30_532_122_624  # "30B"


def test_dense_layers_from_sparse_step_and_mlp_only_layers() -> None:
    raw = dict(QWEN3_30B_A3B, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    raw.pop("num_experts")
    raw["num_local_experts"] = 8  # transformers 5's spelling
    hf = adapter_for(raw).hf
    assert hf.moe_layers == (1, 5) and hf.num_experts == 8
    shapes = mapping.expected_hf_shapes(hf)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (6144, 2048)
    assert "model.layers.3.mlp.gate.weight" not in shapes


@pytest.mark.parametrize(("change", "message"), [
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
    ({"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"mlp_only_layers": list(range(48))}, "no layer is sparse"),
])
def test_unsupported_moe_configs_are_refused_in_one_line(change: dict, message: str) -> None:
    with pytest.raises(UserError, match=message) as err:
        adapter_for(dict(QWEN3_30B_A3B, **change))
    assert "\n" not in str(err.value)


def test_router_mapping_and_expert_parallel_checks() -> None:
    hf = adapter_for(dict(QWEN3_30B_A3B)).hf
    kwargs = moe_config_kwargs(hf, ep=8, etp=1, aux_loss_coeff=0.0)
    # norm_topk_prob=True is megatron's softmax over the top-k logits (no pre-softmax).
    assert kwargs["moe_router_pre_softmax"] is False
    assert kwargs["moe_router_load_balancing_type"] == "none"
    assert kwargs["moe_token_dispatcher_type"] == "alltoall"
    assert kwargs["moe_layer_freq"] == [1] * 48
    on = moe_config_kwargs(hf, ep=1, etp=None, aux_loss_coeff=1e-3)
    assert (on["moe_router_load_balancing_type"], on["moe_aux_loss_coeff"]) == ("aux_loss", 1e-3)
    with pytest.raises(ValueError, match="not divisible by expert_model_parallel_size=3"):
        moe_config_kwargs(hf, ep=3, etp=1, aux_loss_coeff=0.0)
    dense = adapter_for(dict(QWEN3_30B_A3B, architectures=["Qwen3ForCausalLM"], model_type="qwen3")).hf
    assert moe_config_kwargs(dense, ep=1, etp=None, aux_loss_coeff=0.0) == {}
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        moe_config_kwargs(dense, ep=2, etp=None, aux_loss_coeff=0.0)


def test_megatron_router_needs_the_no_te_fallback_name() -> None:
    """megatron-core 0.16.1's RouterGatingLinearFunction reads te_general_gemm, defined only when TE imports."""
    from megatron.core.transformer.moe import moe_utils

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed: moe_utils defines te_general_gemm itself")
    ensure_router_fallback()
    assert moe_utils.te_general_gemm is None
    x, w = torch.randn(5, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    logits = moe_utils.router_gating_linear(x, w, None, torch.float64)
    assert torch.equal(logits, x @ w.t())
