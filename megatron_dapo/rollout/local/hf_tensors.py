"""The local engine's weights under HF checkpoint names, a mixture-of-experts layer's experts one by one.

Weight sync speaks the names of an HF checkpoint, which models/mapping.py exports and
`save_pretrained` writes: one tensor per expert and projection,
``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` ([F, H], [F, H], [H, F]).
transformers 5 holds a Qwen3-MoE layer's experts fused in memory (``Qwen3MoeExperts``:
``gate_up_proj`` [E, 2F, H] with each expert's gate rows before its up rows, and
``down_proj`` [E, H, F]); its conversion_mapping ("qwen2_moe", which qwen3_moe uses) stacks
the per-expert tensors on load and splits them on save. So the engine addresses each expert
tensor as a view into the fused parameter: an update copies one expert's slice in place, and
no fused tensor is ever built from a bucket.
"""

from __future__ import annotations

import re

import torch

__all__ = ["hf_named_tensors", "hf_parameter_names"]

_FUSED = re.compile(r"(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)")
"""transformers' fused expert parameters: ``<layer>.mlp.experts.gate_up_proj`` / ``.down_proj`` (3-d)."""


def _per_expert(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(HF name, view) of each expert projection in a fused tensor, or [(name, tensor)] for any other."""
    match = _FUSED.fullmatch(name)
    if match is None or tensor.dim() != 3:
        return [(name, tensor)]
    prefix = match["prefix"]
    if match["kind"] == "down_proj":  # [E, H, F]
        return [(f"{prefix}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    half = tensor.shape[1] // 2  # [E, 2F, H]: gate rows, then up rows
    return [pair for e in range(tensor.shape[0])
            for pair in ((f"{prefix}.{e}.gate_proj.weight", tensor[e, :half]),
                         (f"{prefix}.{e}.up_proj.weight", tensor[e, half:]))]


def hf_named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state dict under its HF checkpoint name.

    Args:
        model: a transformers causal LM.

    Returns:
        HF name -> tensor sharing the parameter's storage (an expert's projection is a view
        into the fused parameter: copying into it updates the model). Tied aliases (e.g.
        ``lm_head.weight``) are listed under each of their names, as in the state dict.
    """
    return {n: t for name, tensor in model.state_dict().items() for n, t in _per_expert(name, tensor)}


def hf_parameter_names(model: torch.nn.Module) -> set[str]:
    """The HF names a complete weight update must cover: each distinct parameter once, experts per expert.

    Args:
        model: a transformers causal LM.

    Returns:
        Names as in :func:`hf_named_tensors` (a tied weight under one of its names).
    """
    return {n for name, param in model.named_parameters() for n, _ in _per_expert(name, param)}
