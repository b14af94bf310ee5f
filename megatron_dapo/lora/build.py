"""The actor's adapters (model.lora) as its build makes them: the refusals, then apply_lora and the base's identity."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from megatron_dapo.config.model import LoraConfig
from megatron_dapo.lora.layers import LoraModel, apply_lora
from megatron_dapo.lora.state import base_identity

__all__ = ["add_adapters"]

logger = logging.getLogger(__name__)


def add_adapters(model: Any, lora: LoraConfig, hf: Any, dims: Any, *, use_te: bool, seed: int,
                 base: str | Path | None) -> LoraModel:
    """model.lora's adapters on this stage (the actor's build), after refusing what they cannot do.

    Args:
        model: this stage's GPTModel, its base loaded.
        lora: model.lora (rank > 0).
        hf: the model's parsed HF config.
        dims: the layout (ParallelDims).
        use_te: the model uses Transformer Engine's spec (refused).
        seed: trainer.seed.
        base: the base's HF directory (its identity goes into checkpoints); None = a random base.

    Raises:
        ValueError: one line for TE's spec, dropout at TP > 1, or targets the model does not have.
    """
    targets = lora.targets
    if use_te:
        raise ValueError("model.lora: adapters are built on megatron's local layer spec only (Transformer Engine's "
                         "fused linears are not wired yet); set model.transformer_impl=local")
    if lora.dropout and dims.tp > 1:
        raise ValueError(f"model.lora.dropout={lora.dropout} with tensor_model_parallel_size={dims.tp}: the TP ranks' "
                         "dropout masks would differ on replicated inputs; set model.lora.dropout=0")
    explicit = "all-linear" not in lora.target_modules
    if explicit and "experts" in targets and not hf.is_moe:
        raise ValueError("model.lora.target_modules has experts, and this model is dense; leave it out")
    if explicit and hf.is_moe and len(hf.moe_layers) == hf.num_layers and {"linear_fc1", "linear_fc2"} & set(targets):
        raise ValueError("model.lora.target_modules has linear_fc1/linear_fc2, and every layer of this model is an MoE "
                         "layer (no dense MLP): use experts")
    expert_offset = dims.ep_rank * (hf.num_experts // dims.ep) if hf.is_moe else 0
    adapters = apply_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=targets, seed=seed,
                          expert_offset=expert_offset)
    adapters.base = base_identity(base) if base is not None else None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("model.lora: rank %d, alpha %g on %s: %d trainable parameters of %d on this rank (%.2f%%)",
                lora.rank, lora.alpha, ",".join(targets), trainable, total, 100 * trainable / max(total, 1))
    return adapters
