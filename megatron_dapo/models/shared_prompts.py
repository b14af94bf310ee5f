"""Shared-prompt attention: a prompt's tokens go through the model once for all its responses.

In GRPO/DAPO every prompt is sampled n times, so a batch of padded rows pushes each prompt
n times through every layer. On the tiny CPU run prompts are about 70% of a row's tokens:
the actor's forward and backward spent most of their time recomputing the same prompt
activations. The shared-prompt layout (actor/shared_layout.py) packs a micro-batch as
segments in one `[1, T]` sequence, megatron's thd format:

- a *prefix* segment: a prompt shared by two or more rows of the micro-batch, or a whole
  row whose prompt is its own. Its tokens attend causally within the segment.
- a *suffix* segment: the rest of one row (its response) after a shared prompt. Its
  tokens attend to every token of their prompt and causally within the suffix.

This is exactly the attention each row has in the padded layout, so a response token's
output is the same function of the same inputs; only the order of floating-point sums
differs. The gradient of a shared prompt token is the sum over its responses, which
autograd accumulates through the index_select that hands the prompt's keys and values to
each suffix.

Two parts of megatron-core 0.16.1 (the version pinned for CPU and GPU) carry the layout:
- `SharedPromptParams` is a PackedSeqParams (qkv_format "thd") that megatron passes
  unchanged to the core attention; `SdpaDotProductAttention` runs `shared_prompt_attention`
  when it gets one. Only the local layer spec has that attention, so the layout needs it
  (Transformer Engine's thd attention knows cu_seqlens, not prefixes).
- RoPE: in thd format megatron applies `freqs[i]` to packed token i when the rotary
  embedding has exactly one row per packed token (`_apply_rotary_pos_emb_thd`, "exact
  mapping"), else restarts positions at every cu_seqlens boundary. `enable_token_positions`
  makes the model's RotaryEmbedding return one row per token, gathered at the
  micro-batch's position ids (a suffix token of a prompt of length p at offset j has
  position p + j), while `token_positions(model, positions)` is active.
tests/multirank/test_actor_train_step.py holds both to float64 transformers (log-probs and
the gradient, shared prompts in every TP/PP/DP layout); tests/unit/test_actor_shared_layout.py
checks every token's attention set against its padded row's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

__all__ = ["SharedPromptParams", "enable_token_positions", "shared_prompt_attention", "token_positions"]


@dataclass
class SharedPromptParams(PackedSeqParams):
    """The thd PackedSeqParams of a shared-prompt micro-batch plus its segment structure.

    cu_seqlens_q/kv are [0, T] (one packed sequence as far as RoPE's split is concerned)
    and max_seqlen_q/kv the largest position + 1 (the rotary table's length).
    """

    prefix_index: list[torch.Tensor] = None
    """Per group of prefixes of similar length: [P, Lp] int64 packed index of each prefix
    token (right-padded by repeating the segment's last token)."""
    suffix_index: list[torch.Tensor] = None
    """Per group of suffixes: [Q, Ls] int64 packed index of each suffix token (padded likewise)."""
    suffix_kv_index: list[torch.Tensor] = None
    """Per group of suffixes: [Q, Lp + Ls] int64 keys of each suffix: its prefix's tokens, then its own."""
    suffix_mask: list[torch.Tensor] = None
    """Per group of suffixes: [Q, 1, Ls, Lp + Ls] bool, key j is visible to query i of the suffix."""
    out_index: torch.Tensor = None
    """[T] int64 row of each packed token in the concatenated outputs of every group, prefix
    groups first, each [P, Lp] or [Q, Ls] flattened."""


def shared_prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            params: SharedPromptParams, scale: float | None) -> torch.Tensor:
    """Attention of a shared-prompt micro-batch.

    Args:
        query: [T, np, hn] packed queries (megatron squeezes thd's batch dimension).
        key: [T, ng, hn] packed keys, ng dividing np (grouped-query attention).
        value: [T, ng, hn].
        params: the micro-batch's segment structure.
        scale: softmax scale (None = 1 / sqrt(hn)).

    Returns:
        [T, np * hn] the context of every packed token.
    """
    gqa = query.shape[1] != key.shape[1]

    def rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [B, heads, L, hn]
        return t.index_select(0, index.reshape(-1)).view(*index.shape, *t.shape[1:]).transpose(1, 2)

    outs = [F.scaled_dot_product_attention(rows(query, index), rows(key, index), rows(value, index),
                                           is_causal=True, scale=scale, enable_gqa=gqa)
            for index in params.prefix_index]
    for index, kv, mask in zip(params.suffix_index, params.suffix_kv_index, params.suffix_mask, strict=True):
        outs.append(F.scaled_dot_product_attention(rows(query, index), rows(key, kv), rows(value, kv),
                                                   attn_mask=mask, scale=scale, enable_gqa=gqa))
    width = query.shape[1] * query.shape[2]
    flat = torch.cat([o.transpose(1, 2).reshape(-1, width) for o in outs])
    return flat.index_select(0, params.out_index)


def enable_token_positions(gpt: Any) -> None:
    """Let `token_positions` give `gpt`'s RotaryEmbedding one row per packed token (idempotent)."""
    rope = getattr(gpt, "rotary_pos_emb", None)
    if rope is None or getattr(rope, "token_positions", False) is not False:
        return
    rope.token_positions = None
    table = type(rope).forward  # megatron's lru-cached table of positions 0..max_seq_len-1

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None) -> torch.Tensor:
        emb = table(rope, max_seq_len, offset, packed_seq, cp_group)
        positions = rope.token_positions
        if positions is None or not packed_seq:
            return emb
        return emb.index_select(0, positions)  # [T, 1, 1, d]: exact mapping in _apply_rotary_pos_emb_thd

    rope.forward = forward


@contextlib.contextmanager
def token_positions(gpt: Any, positions: torch.Tensor | None) -> Iterator[None]:
    """While active, the GPTModel `gpt`'s packed forward applies RoPE at `positions` [T] (None: no change)."""
    rope = getattr(gpt, "rotary_pos_emb", None) if positions is not None else None
    if rope is None:
        yield
        return
    if getattr(rope, "token_positions", False) is not None:
        raise RuntimeError("the model's RotaryEmbedding was not prepared for shared-prompt micro-batches; "
                           "build it with DecoderAdapter.build_model (local spec)")
    rope.token_positions = positions
    try:
        yield
    finally:
        rope.token_positions = None
