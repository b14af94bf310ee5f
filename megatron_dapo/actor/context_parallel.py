"""Context-parallel sequence split, gather and loss scale (pure torch), and the one CP collective.

Context parallelism (CP) gives each of the `cp` ranks of a CP group a part of every
sequence; attention exchanges keys and values between them (Transformer Engine's ring
attention, `cp_comm_type` "p2p", or its all-gather / all-to-all variants). Causal
attention makes late tokens costlier than early ones, so megatron-core and TE balance the
work: a sequence of length S (a multiple of 2 x cp) is cut into 2 x cp equal chunks and
rank r holds chunks r and 2cp - 1 - r (`cp_positions`). For packed (thd) batches TE
partitions every sequence that way on its own, each padded to a multiple of 2 x cp
(`thd_cp_positions`, the order of TE's thd_get_partitioned_indices). Under sequence
parallelism the chunks are split once more over TP ranks, so lengths are padded to a
multiple of 2 x cp x tp (`cp_pad_multiple`).

Targets must be shifted BEFORE the split: position t predicts token t + 1, and the two
may sit on different ranks. Then every per-token tensor (tokens, positions, targets,
masks, advantages, old/ref log-probs) is split with the same positions, and the
per-token results (log-probs, entropy) are put back in order with `gather_sequence`.

Loss scale. Megatron-core 0.16.1 multiplies a loss function's output by cp and divides it
by the number of micro-batches (forward_step_calc_loss), and DDP pre-scales gradients by
1 / (dp x cp) before summing them over the dp x cp ranks. If every rank returns
`loss_r x microbatch_loss_scale(num_microbatches, dp)`, the summed gradient is
sum_r d(loss_r) / d(theta): the cp factors cancel. So each rank's loss_r must be its
share of the global objective: its own tokens' loss sum over the GLOBAL counts (summed
over dp x cp), or, after gathering the log-probs of the whole sequence over CP with a
backward that keeps only this rank's positions' gradient, the whole loss over dp-summed
counts. Returning the whole loss from every rank with a gather whose backward sums over
CP would make the gradient cp times too large. The actor takes the gather route
(`gather_over_cp`): every CP rank then computes the whole loss, so every loss mode works
unchanged, with the same counts and scale as without CP.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "cp_pad_multiple",
    "cp_positions",
    "gather_over_cp",
    "gather_sequence",
    "microbatch_loss_scale",
    "split_sequence",
    "thd_cp_positions",
]


def cp_pad_multiple(cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """The multiple every sequence length must be padded to.

    Args:
        cp: context-parallel size.
        tp: tensor-parallel size.
        sequence_parallel: Megatron sequence parallelism (splits each CP chunk over TP too).

    Returns:
        2 x cp (1 without CP), times tp under sequence parallelism.
    """
    if cp < 1 or tp < 1:
        raise ValueError(f"cp={cp} and tp={tp} must be >= 1")
    multiple = 2 * cp if cp > 1 else 1
    return multiple * tp if sequence_parallel else multiple


def cp_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions of a length-`seq_len` sequence that CP rank `cp_rank` holds, in its order.

    Args:
        seq_len: the (padded) sequence length, a multiple of 2 x cp.
        cp: context-parallel size.
        cp_rank: this rank's index in the CP group.

    Returns:
        [seq_len / cp] int64: chunk cp_rank, then chunk 2cp - 1 - cp_rank, of 2cp equal chunks.
    """
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} must lie in [0, {cp})")
    if cp == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp) != 0:
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x cp = {2 * cp}; pad it first "
                         "(cp_pad_multiple)")
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([first, second])


def thd_cp_positions(cu_seqlens_padded: torch.Tensor | Sequence[int], cp: int, cp_rank: int) -> torch.Tensor:
    """Positions of a packed (thd) batch that CP rank `cp_rank` holds: every sequence split on its own.

    Args:
        cu_seqlens_padded: [n + 1] cumulative lengths of the sequences, each padded to a
            multiple of 2 x cp.
        cp: context-parallel size.
        cp_rank: this rank's index in the CP group.

    Returns:
        [total / cp] int64 positions into the packed batch: for each sequence in order, its
        chunks cp_rank and 2cp - 1 - cp_rank.
    """
    bounds = [int(b) for b in cu_seqlens_padded]
    parts = [start + cp_positions(end - start, cp, cp_rank) for start, end in itertools.pairwise(bounds)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def split_sequence(t: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's part of `t` along the sequence dimension `dim` (cp_positions / thd_cp_positions)."""
    return t.index_select(dim, positions.to(t.device))


def gather_sequence(parts: Sequence[torch.Tensor], positions: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Undo the split: put every rank's part back at its positions.

    Args:
        parts: each CP rank's part (e.g. from an all-gather), in rank order.
        positions: each rank's positions, as passed to split_sequence.
        dim: the sequence dimension.

    Returns:
        The whole tensor, sequence order restored.
    """
    if len(parts) != len(positions):
        raise ValueError(f"{len(parts)} parts but {len(positions)} position lists; pass one per CP rank")
    order = torch.cat([p.to(parts[0].device) for p in positions])
    stacked = torch.cat(list(parts), dim=dim)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return stacked.index_select(dim, inverse)


def microbatch_loss_scale(num_microbatches: int, dp: int) -> int:
    """What each micro-batch's loss is multiplied by so the summed gradient is the global objective's.

    Undoes the schedule's 1 / num_microbatches and DDP's 1 / dp; CP's factors (the
    schedule's x cp, DDP's 1 / cp) cancel each other (module docstring), provided every
    rank returns its own share of the objective.
    """
    if num_microbatches < 1 or dp < 1:
        raise ValueError(f"num_microbatches={num_microbatches} and dp={dp} must be >= 1")
    return num_microbatches * dp


class _GatherOverCP(torch.autograd.Function):
    """All-gather the CP ranks' parts in sequence order; backward keeps this rank's positions."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, local: torch.Tensor, group: dist.ProcessGroup,
                positions: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        parts = [torch.empty_like(local) for _ in positions]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.held = positions[dist.get_rank(group)]
        return gather_sequence(parts, positions, dim=1)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        # Every CP rank computes the same whole loss from the gathered values; the gradient
        # through this rank's own positions is its share, and the CP ranks' shares sum (DDP
        # over dp x cp) to the whole gradient. Summing the gradient over CP here would count
        # it cp times.
        return grad.index_select(1, ctx.held.to(grad.device)), None, None


def gather_over_cp(local: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """Per-token values of this CP rank's positions -> the whole sequences, on every CP rank.

    Collective over `group`; differentiable (see _GatherOverCP.backward).

    Args:
        local: [n, S / cp] values at this rank's positions (cp_positions(S, cp, rank) order).
        group: the context-parallel group.
        cp: its size.

    Returns:
        [n, S] in sequence order.
    """
    seq_len = local.shape[1] * cp
    positions = [cp_positions(seq_len, cp, r) for r in range(cp)]
    return _GatherOverCP.apply(local, group, positions)

