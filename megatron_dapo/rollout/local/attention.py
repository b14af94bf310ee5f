"""The local engine's attention: torch SDPA reading grouped key/value heads in place.

transformers' "sdpa" attention (5.19) passes `enable_gqa=True` to torch only without an
attention mask; with one (every batched decode step: rows have different lengths) it
first copies each layer's whole KV cache to the query head count (`repeat_kv`), at every
decode step. On the tiny CPU run that copy was the largest single cost of generation
(17% of it under py-spy), and torch's SDPA takes the grouped heads directly with a mask
too, with the same result (the same kernel reads the same values). This registers that
attention under its own name, with transformers' own SDPA mask builder, through the
public AttentionInterface / AttentionMaskInterface registries.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ATTENTION", "attention_for", "register_attention"]

ATTENTION = "megatron_dapo_sdpa"

_FAMILIES = frozenset({"qwen2", "llama", "qwen3", "qwen3_moe"})
"""Model types whose attention is plain causal SDPA (what models/ adapts; Qwen3's QK-norm is
applied before the attention call); for any other the engine keeps transformers' default,
which knows the model's own attention variants."""


def _sdpa_gqa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [b, heads, q, d], key/value [b, kv_heads, k, d] -> ([b, q, heads, d], None).

    Other keyword arguments are ignored as transformers' sdpa ignores them (a sliding window
    is already in the mask).
    """
    del kwargs
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_len = query.shape[2]
    # As transformers' sdpa: is_causal only for a prefill without a mask (top-left aligned).
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > q_len:
        raise ValueError(f"causal attention of {q_len} queries over {key.shape[2]} cached keys needs a mask")
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def attention_for(model_type: str, device_type: str) -> str | None:
    """The attn_implementation for an HF config's model_type on a device (registered), or None for the default.

    CPU only: on CUDA a mask with grouped KV heads puts torch's SDPA on its math kernel,
    which transformers' own sdpa avoids by copying the heads (`use_gqa_in_sdpa`); there the
    copy is the cheaper side of that trade, so GPUs keep transformers' default.
    """
    return register_attention() if model_type in _FAMILIES and device_type == "cpu" else None


def register_attention() -> str:
    """Register the attention (idempotent); returns the name to pass as attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _sdpa_gqa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION
