"""Where each token's routes go in a micro-batch, in every layout (pure torch; issue 26).

Routing replay hands each MoE router the expert ids of the tokens it sees, in the order it
sees them. megatron-core 0.16.1's TopKRouter flattens its input `[s, b, h]` to `[s * b, E]`
logits (`TopKRouter.routing`: `logits.view(-1, E)`), so router token i is sequence position
i // b of batch row i % b, after context parallelism took the rank's chunks of the sequence
and sequence parallelism its contiguous `1 / tp` of them. A micro-batch's model input is
`[n, S]` padded rows, or `[1, T]` for the packed (thd) and shared-prompt layouts.

Two maps, used in both directions (replay: rows -> router; recording and checking:
router -> rows):
- `token_index(mb)` [n, S]: the model-order position (`s * b + row`, b = input_ids.shape[0])
  of token t of row r, -1 where that position predicts nothing (padding and each row's last
  token, whose route no log-prob reads). Padded rows: t * n + r; packed: the inverse of
  flat_index; shared prompts: source_index (a shared prompt's positions serve every row that
  shares it: their routes must agree, which `prompt_groups` ensures by keying prompts on
  their routes too).
- `local_positions(...)` [T_local]: the model-order positions this rank's routers see, in
  their order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron_dapo.actor.context_parallel import cp_positions
from megatron_dapo.actor.microbatch import MicroBatch
from megatron_dapo.rollout.routes import NO_ROUTE

__all__ = ["local_positions", "model_order_targets", "pad_routes", "rows_from_model_order", "token_index"]


def pad_routes(per_row: Sequence[np.ndarray | None], width: int) -> torch.Tensor | None:
    """[B, width, L, k] int16 routes of right-padded rows (-1 where a row has none); None if no row has any.

    Args:
        per_row: each row's [tokens, L, k] routes (tokens <= width), or None.
        width: the padded row width.
    """
    shapes = {r.shape[1:] for r in per_row if r is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"routes of one batch disagree on [L, k]: {sorted(shapes)}")
    (layers, k), = shapes
    out = torch.full((len(per_row), width, layers, k), NO_ROUTE, dtype=torch.int16)
    for i, r in enumerate(per_row):
        if r is not None:
            out[i, : r.shape[0]] = torch.from_numpy(r.astype(np.int16))
    return out


def token_index(mb: MicroBatch) -> torch.Tensor:
    """[n, S] int64 model-order position of each row token, -1 where the position predicts nothing."""
    n_rows, width = mb.targets.shape
    device = mb.targets.device
    if mb.source_index is not None:
        index = mb.source_index.clone()
    elif mb.flat_index is not None:
        index = torch.full((n_rows * width,), NO_ROUTE, dtype=torch.long, device=device)
        index[mb.flat_index] = torch.arange(mb.flat_index.numel(), device=device)
        index = index.view(n_rows, width)
    else:  # padded [n, S]: the router's token s * n + r
        t = torch.arange(width, device=device).unsqueeze(0)
        r = torch.arange(n_rows, device=device).unsqueeze(1)
        index = t * n_rows + r
    return index.masked_fill(~mb.valid, NO_ROUTE)


def local_positions(input_shape: Sequence[int], *, cp: int = 1, cp_rank: int = 0, tp: int = 1, tp_rank: int = 0,
                    sequence_parallel: bool = False) -> torch.Tensor:
    """[T_local] model-order positions a rank's routers see, in router order.

    Args:
        input_shape: the micro-batch's model input [b, S] (before the CP split).
        cp, cp_rank: context parallelism: the rank holds cp_positions(S, cp, cp_rank).
        tp, tp_rank, sequence_parallel: with SP the rank holds the tp_rank-th contiguous
            1 / tp of the (CP-local) sequence.
    """
    b, seq = int(input_shape[0]), int(input_shape[1])
    held = cp_positions(seq, cp, cp_rank)
    if sequence_parallel and tp > 1:
        chunk = held.numel() // tp
        held = held[tp_rank * chunk:(tp_rank + 1) * chunk]
    return (held.unsqueeze(1) * b + torch.arange(b).unsqueeze(0)).reshape(-1)


def model_order_targets(mb: MicroBatch, routes: torch.Tensor | None, num_layers: int,
                        top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routes of every model-order position of a micro-batch.

    Args:
        mb: the micro-batch.
        routes: [n, S, L, k] its rows' routes (MicroBatch.routes / replay_routes), -1 = none; None = none at all.

    Returns:
        (targets [T, L, k] int64, has_route [T] bool), T = mb.input_ids.numel(); positions without
        a route get experts 0..k-1 (what they route to changes no log-prob).
    """
    num_positions = mb.input_ids.numel()
    device = mb.input_ids.device
    targets = torch.arange(top_k, device=device).expand(num_positions, num_layers, top_k).clone()
    has_route = torch.zeros(num_positions, dtype=torch.bool, device=device)
    if routes is None:
        return targets, has_route
    index = token_index(mb)
    keep = (index >= 0) & (routes[..., 0, 0] >= 0)
    targets[index[keep]] = routes[keep].to(device=device, dtype=torch.long)
    has_route[index[keep]] = True
    return targets, has_route


def rows_from_model_order(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
    """Model-order routes [T, L, k] (-1 = unknown) as rows [n, S, L, k], -1 where the position predicts nothing."""
    index = token_index(mb)
    out = values.new_full((*index.shape, *values.shape[1:]), NO_ROUTE)
    keep = index >= 0
    out[keep] = values[index[keep]]
    return out
