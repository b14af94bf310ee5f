"""Llama adapter (Llama 2/3 without rope scaling): no biases, optional tied embeddings."""

from __future__ import annotations

from typing import Any, ClassVar

from megatron_dapo.models.adapter import DecoderAdapter
from megatron_dapo.models.config import parse_decoder_config


class LlamaAdapter(DecoderAdapter):
    """LlamaForCausalLM."""

    __slots__ = ()

    architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any], source: str) -> LlamaAdapter:
        """Parse a Llama config.json.

        Args:
            raw: config.json as a dict.
            source: its path, for messages.

        Returns:
            The adapter; raises ValueError listing every unsupported feature.
        """
        problems = []
        # HF's attention_bias also puts a bias on o_proj, which megatron's add_qkv_bias lacks.
        if raw.get("attention_bias", False):
            problems.append("attention_bias=true (biased attention projections are not supported)")
        if raw.get("mlp_bias", False):
            problems.append("mlp_bias=true (biased MLP projections are not supported)")
        return cls(hf=parse_decoder_config(raw, source, family="llama", qkv_bias=False, problems=problems))
