"""The planner's LoRA terms (model.lora): adapter parameters per GPU, the frozen base, the sync bytes.

With adapters the base weights are frozen: one GPU holds its base shard in the parameter dtype
and nothing else for it (no gradient buffer, no fp32 master, no Adam moments: DDP and the
optimizer see only parameters that require a gradient, megatron-core 0.16.1's
distributed_data_parallel.py and optimizer/__init__.py). The adapters carry the full model states
(plan/model.model_state_bytes_per_param), sharded as lora/layers.py shards them: a column-parallel
linear's A [r, in] whole on every TP rank and B [out/TP, r]; a row-parallel one's A [r, in/TP] and
B [out, r] whole. A routed expert (ETP 1 with adapters) holds both whole, on its EP rank.

The adapter-only sync (rollout.lora_sync=adapter) moves the adapters in bf16: r x (in + out) per
adapted linear, against the whole model for the merged sync.
"""

from __future__ import annotations

from megatron_dapo.plan.dims import ModelDims
from megatron_dapo.plan.stages import stage_layers

__all__ = ["base_bytes_per_param", "lora_linears", "lora_params_per_gpu", "lora_sync_bytes"]


def lora_linears(dims: ModelDims, targets: tuple[str, ...], sparse: bool) -> list[tuple[str, int, int]]:
    """(kind, in, out) of a layer's adapted linears (kind: column | row | expert), one entry per expert."""
    h = dims.hidden_size
    out: list[tuple[str, int, int]] = []
    if "linear_qkv" in targets:
        out.append(("column", h, dims.q_dim + 2 * dims.kv_dim))
    if "linear_proj" in targets:
        out.append(("row", dims.q_dim, h))
    if not sparse:
        if "linear_fc1" in targets:
            out.append(("column", h, 2 * dims.intermediate_size))
        if "linear_fc2" in targets:
            out.append(("row", dims.intermediate_size, h))
    elif "experts" in targets:
        f = dims.moe_intermediate_size
        out += [("expert", h, 2 * f), ("expert", f, h)] * dims.num_experts
    return out


def _per_gpu(kind: str, rank: int, n_in: int, n_out: int, tp: int, ep: int) -> float:
    if kind == "column":
        return rank * n_in + rank * n_out / tp
    if kind == "row":
        return rank * n_in / tp + rank * n_out
    return rank * (n_in + n_out) / ep


def lora_params_per_gpu(dims: ModelDims, *, rank: int, targets: tuple[str, ...], tp: int, pp: int, ep: int) -> int:
    """Adapter parameters on one GPU of the fullest pipeline stage."""
    layers = stage_layers(dims.num_layers, pp)
    sparse_layers = set(dims.moe_layers) if dims.is_moe else set()
    best = 0.0
    for stage in range(pp):
        first = sum(layers[:stage])
        total = 0.0
        for layer in range(first, first + layers[stage]):
            total += sum(_per_gpu(k, rank, i, o, tp, ep) for k, i, o in lora_linears(dims, targets, layer in sparse_layers))
        best = max(best, total)
    return int(best)


def lora_sync_bytes(dims: ModelDims, *, rank: int, targets: tuple[str, ...]) -> int:
    """Bytes of the whole model's adapters in bf16: what an adapter-only sync sends each engine."""
    sparse_layers = set(dims.moe_layers) if dims.is_moe else set()
    return 2 * sum(rank * (i + o) for layer in range(dims.num_layers)
                   for _, i, o in lora_linears(dims, targets, layer in sparse_layers))


def base_bytes_per_param(bf16: bool) -> int:
    """A frozen base weight: its value alone, in the parameter dtype."""
    return 2 if bf16 else 4
