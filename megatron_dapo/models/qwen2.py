"""Qwen2 / Qwen2.5 adapter: Llama layout plus q/k/v biases; tied embeddings in the small sizes."""

from __future__ import annotations

from typing import Any, ClassVar

from megatron_dapo.models.adapter import DecoderAdapter
from megatron_dapo.models.config import parse_decoder_config


class Qwen2Adapter(DecoderAdapter):
    """Qwen2ForCausalLM (Qwen2 and Qwen2.5 share the architecture)."""

    __slots__ = ()

    architectures: ClassVar[tuple[str, ...]] = ("Qwen2ForCausalLM",)

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any], source: str) -> Qwen2Adapter:
        """Parse a Qwen2 config.json.

        Args:
            raw: config.json as a dict.
            source: its path, for messages.

        Returns:
            The adapter; raises ValueError listing every unsupported feature.
        """
        problems = []
        if raw.get("use_sliding_window", False):
            problems.append("use_sliding_window=true (sliding-window attention is not supported)")
        return cls(hf=parse_decoder_config(raw, source, family="qwen2", qkv_bias=True, problems=problems))
