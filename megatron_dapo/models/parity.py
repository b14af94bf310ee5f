"""Numerical parity between a Megatron model and transformers' model of the same checkpoint.

Used by tools/check_parity.py (operators run it after conversion or on a new cluster) and
by the conversion tests: a forward-only pass through megatron's pipeline schedule that
returns full-vocabulary log-probs, and the two numbers that decide parity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.parallel import ParallelDims


def full_vocab_log_probs(
    model: Any, dims: ParallelDims, tokens: torch.Tensor, vocab_size: int
) -> torch.Tensor | None:
    """Forward ``tokens`` through this rank's stage; log-probs over the real vocab on the last stage.

    Collective over the model-parallel group (pipeline p2p, TP all-gather of the vocab shards).

    Args:
        model: this stage's GPTModel (or wrapper).
        dims: its layout.
        tokens: [B, S] token ids on dims.device, identical on every rank of the replica.
        vocab_size: real vocab V; Megatron's padding rows are dropped before the softmax.

    Returns:
        [B, S, V] float32 log-probs on last-stage ranks, None on the others.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    captured: list[torch.Tensor] = []

    def forward_step(data_iterator: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
        next(data_iterator)
        output = chunk(tokens, positions, None)

        def keep(logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            captured.append(logits.detach())
            return logits.new_zeros(()), {}

        return output, keep

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([0]),
            model=[model],
            num_microbatches=1,
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
            forward_only=True,
        )
    if not dims.is_last_stage:
        return None
    local = captured[0]  # [B, S, Vp/tp]
    if dims.tp > 1:
        shards = [torch.empty_like(local) for _ in range(dims.tp)]
        dist.all_gather(shards, local.contiguous(), group=dims.tp_group)
        local = torch.cat(shards, dim=-1)  # [B, S, Vp]
    return torch.log_softmax(local[..., :vocab_size].float(), dim=-1)


def compare_log_probs(
    reference: torch.Tensor, candidate: torch.Tensor, tokens: torch.Tensor
) -> tuple[float, float]:
    """Parity numbers of two [B, S, V] log-prob tensors for the same [B, S] tokens.

    Args:
        reference: transformers' log-probs.
        candidate: Megatron's log-probs.
        tokens: the input ids; position t is scored on token t+1.

    Returns:
        (max |log p_ref - log p_cand| over the actual next tokens,
         mean over positions of KL(p_ref || p_cand)).
    """
    if reference.shape != candidate.shape:
        raise ValueError(
            f"log-prob shapes differ: reference {tuple(reference.shape)} vs {tuple(candidate.shape)}"
        )
    reference, candidate = reference.float(), candidate.float()
    next_tokens = tokens[:, 1:].unsqueeze(-1)  # [B, S-1, 1]
    ref_next = reference[:, :-1].gather(-1, next_tokens)
    cand_next = candidate[:, :-1].gather(-1, next_tokens)
    max_diff = (ref_next - cand_next).abs().max().item()
    kl = (reference.exp() * (reference - candidate)).sum(-1)  # [B, S]
    return max_diff, kl.mean().item()
