"""Qwen3 (dense) and Qwen3-MoE adapters: the Llama layout plus QK-norm, and routed experts.

Qwen3 differs from Llama by an RMSNorm over every query and key head before RoPE
(megatron's ``qk_layernorm``). Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) replaces the MLP
of the layers picked by ``decoder_sparse_step`` / ``mlp_only_layers`` with a top-k softmax
router over ``num_experts`` SwiGLU experts and no shared expert; the other layers keep a
dense MLP of ``intermediate_size``. How these map onto megatron-core is in
adapter.DecoderAdapter (transformer_config, stage_spec) and mapping.py (tensor names).
"""

from __future__ import annotations

from typing import Any, ClassVar

from megatron_dapo.models.adapter import DecoderAdapter
from megatron_dapo.models.config import parse_decoder_config


def _qwen3_problems(raw: dict[str, Any]) -> list[str]:
    problems = []
    if raw.get("use_sliding_window", False):
        problems.append("use_sliding_window=true (sliding-window attention is not supported)")
    # HF's attention_bias also puts a bias on o_proj, which megatron's add_qkv_bias lacks.
    if raw.get("attention_bias", False):
        problems.append("attention_bias=true (biased attention projections are not supported)")
    return problems


class Qwen3Adapter(DecoderAdapter):
    """Qwen3ForCausalLM (dense Qwen3)."""

    __slots__ = ()

    architectures: ClassVar[tuple[str, ...]] = ("Qwen3ForCausalLM",)

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any], source: str) -> Qwen3Adapter:
        """Parse a Qwen3 config.json.

        Args:
            raw: config.json as a dict.
            source: its path, for messages.

        Returns:
            The adapter; raises a UserError listing every unsupported feature.
        """
        return cls(hf=parse_decoder_config(raw, source, family="qwen3", qkv_bias=False,
                                           problems=_qwen3_problems(raw), qk_norm=True))


class Qwen3MoeAdapter(DecoderAdapter):
    """Qwen3MoeForCausalLM: QK-norm attention, top-k routed experts without a shared expert."""

    __slots__ = ()

    architectures: ClassVar[tuple[str, ...]] = ("Qwen3MoeForCausalLM",)

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any], source: str) -> Qwen3MoeAdapter:
        """Parse a Qwen3-MoE config.json.

        ``num_experts`` may be spelled ``num_local_experts`` (transformers 5's save_pretrained
        writes that name). Layer i is sparse when i is not in ``mlp_only_layers``, ``num_experts > 0`` and
        ``(i + 1) % decoder_sparse_step == 0`` (transformers' Qwen3MoeDecoderLayer).

        Args:
            raw: config.json as a dict.
            source: its path, for messages.

        Returns:
            The adapter; raises a UserError listing every unsupported feature.
        """
        problems = _qwen3_problems(raw)
        # Qwen's own config.json says num_experts; transformers 5 writes it as num_local_experts.
        raw = {**raw, "num_experts": raw.get("num_experts", raw.get("num_local_experts"))}
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if not isinstance(raw.get(key), int) or raw[key] <= 0:
                problems.append(f"{key}={raw.get(key)!r} (a positive integer is required)")
        if raw.get("shared_expert_intermediate_size"):
            problems.append("shared_expert_intermediate_size is set (Qwen3-MoE has no shared expert; "
                            "this looks like a Qwen2-MoE config)")
        num_layers = raw.get("num_hidden_layers", 0)
        step = raw.get("decoder_sparse_step", 1) or 1
        dense_only = set(raw.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
        if not problems and not moe_layers:
            problems.append(f"no layer is sparse (decoder_sparse_step={step}, mlp_only_layers={sorted(dense_only)}); "
                            "use a dense Qwen3 config")
        shape: dict[str, Any] = {}
        if not problems:
            shape = {"num_experts": raw["num_experts"], "num_experts_per_tok": raw["num_experts_per_tok"],
                     "moe_intermediate_size": raw["moe_intermediate_size"],
                     "norm_topk_prob": bool(raw.get("norm_topk_prob", False)), "moe_layers": moe_layers}
        return cls(hf=parse_decoder_config(raw, source, family="qwen3_moe", qkv_bias=False, problems=problems,
                                           qk_norm=True, **shape))
