"""Model families: HF config.json -> Megatron GPTModel, and HF weights in and out of any TP/PP layout.

``adapter_for(path_or_config)`` picks the family from config.json's ``model_type`` (or
``architectures``) and returns its adapter; see adapter.ModelAdapter for the interface.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_dapo.errors import UserError
from megatron_dapo.models.adapter import DecoderAdapter, ModelAdapter, unwrap_model
from megatron_dapo.models.config import HFModelConfig
from megatron_dapo.models.hf_checkpoint import HFCheckpoint, read_hf_config
from megatron_dapo.models.llama import LlamaAdapter
from megatron_dapo.models.qwen2 import Qwen2Adapter
from megatron_dapo.models.qwen3 import Qwen3Adapter, Qwen3MoeAdapter
from megatron_dapo.models.transformer_impl import choose_transformer_impl, te_available, te_status

ADAPTERS: dict[str, type[DecoderAdapter]] = {
    "qwen2": Qwen2Adapter, "llama": LlamaAdapter, "qwen3": Qwen3Adapter, "qwen3_moe": Qwen3MoeAdapter,
}

__all__ = [
    "ADAPTERS",
    "DecoderAdapter",
    "HFCheckpoint",
    "HFModelConfig",
    "LlamaAdapter",
    "ModelAdapter",
    "Qwen2Adapter",
    "Qwen3Adapter",
    "Qwen3MoeAdapter",
    "adapter_for",
    "choose_transformer_impl",
    "read_hf_config",
    "te_available",
    "te_status",
    "unwrap_model",
]


def adapter_for(source: str | Path | dict[str, Any]) -> DecoderAdapter:
    """The adapter of the model family described by a checkpoint directory or a config dict.

    Args:
        source: HF checkpoint directory, or config.json already parsed into a dict.

    Returns:
        The family's adapter (Qwen2Adapter, LlamaAdapter, Qwen3Adapter, Qwen3MoeAdapter) bound to the parsed config.
    """
    if isinstance(source, dict):
        raw, where = source, "the given config"
    else:
        raw, where = read_hf_config(source), str(Path(source) / "config.json")
    family = raw.get("model_type")
    if family not in ADAPTERS:
        by_arch = {arch: name for name, cls in ADAPTERS.items() for arch in cls.architectures}
        family = next((by_arch[a] for a in raw.get("architectures") or [] if a in by_arch), None)
    if family is None:
        raise UserError(
            f"{where} has model_type={raw.get('model_type')!r}, architectures={raw.get('architectures')}; "
            f"supported model types are {sorted(ADAPTERS)}"
        )
    return ADAPTERS[family].from_hf_config(raw, where)
