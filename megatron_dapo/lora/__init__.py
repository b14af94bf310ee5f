"""LoRA on the Megatron actor (model.lora): adapters on tensor-parallel linears (layers.py),
their checkpoints, merged exports and base identity (state.py), PEFT's adapter format (peft.py)."""

from megatron_dapo.lora.build import add_adapters
from megatron_dapo.lora.layers import LoraModel, LoraSite, apply_lora, is_lora_param, lora_of
from megatron_dapo.lora.state import (
    MergedParams,
    base_identity,
    export_params,
    load_state,
    sharded_state_dict,
)

__all__ = [
    "LoraModel",
    "LoraSite",
    "MergedParams",
    "add_adapters",
    "apply_lora",
    "base_identity",
    "export_params",
    "is_lora_param",
    "load_state",
    "lora_of",
    "sharded_state_dict",
]
