"""Megatron-core's local core attention computed by torch's fused scaled_dot_product_attention.

The local (non-Transformer-Engine) layer spec, which CPU runs use, gets megatron-core's
DotProductAttention: it materialises the [b, heads, s, s] scores, repeats the key/value
heads for grouped-query attention, masks and softmaxes in separate kernels and keeps the
probabilities for backward. torch's SDPA does the same math in one fused kernel (flash
attention on CPU too), reads the grouped key/value heads without copying them and keeps
only the log-sum-exp for backward. On the tiny CPU run that was the costliest part of the
actor's forward and backward after the matmuls.

Only the configurations the padded CPU layout uses take the fused path: causal masking
without an explicit mask (right padding never affects a real token under a causal mask),
no attention dropout while training, no sliding window, no softmax offset, no packing.
Anything else falls back to DotProductAttention unchanged, except a shared-prompt
micro-batch (models/shared_prompts.py), which only this attention can run: it needs the
same conditions as the fused path and fails with a clear error without them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_dapo.models.shared_prompts import SharedPromptParams, shared_prompt_attention

__all__ = ["SdpaDotProductAttention"]


class SdpaDotProductAttention(DotProductAttention):
    """DotProductAttention whose causal, unmasked case runs as one fused SDPA call."""

    def _fused_ok(self, attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None,
                  attention_bias: torch.Tensor | None, packed_seq_params: PackedSeqParams | None) -> bool:
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        dropout = self.attention_dropout.p if self.training else 0.0
        return (mask_type == AttnMaskType.causal and attention_mask is None and attention_bias is None
                and packed_seq_params is None and self.softmax_offset is None and dropout == 0.0
                and not self.config.apply_query_key_layer_scaling
                and self.scale_mask_softmax.window_size is None)

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Causal attention of one micro-batch.

        Args:
            query: [sq, b, np, hn].
            key: [sk, b, ng, hn] (ng key/value groups, np a multiple of ng).
            value: [sk, b, ng, hn].
            attention_mask: None on the fused path; other arguments as DotProductAttention.

        Returns:
            context: [sq, b, np * hn].
        """
        if isinstance(packed_seq_params, SharedPromptParams):
            if not self._fused_ok(attention_mask, attn_mask_type, attention_bias, None):
                raise ValueError("shared-prompt micro-batches need causal attention without an explicit mask, "
                                 "bias, dropout, sliding window or softmax offset; build the actor with "
                                 "shared_prompts=False (trainer.shared_prompts=false) for this model")
            return shared_prompt_attention(query, key, value, packed_seq_params, self.softmax_scale)
        if not self._fused_ok(attention_mask, attn_mask_type, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        context = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
        )  # [b, np, sq, hn]
        sq, b = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
