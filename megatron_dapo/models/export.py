"""HF tensors out of any Megatron layout: who receives them, and what each rank holds meanwhile.

``DecoderAdapter.export_hf`` streams the model as full HF-named tensors, one at a time, for
weight sync (step 7 of the RL step), the warm start's checks and checkpoint, and the
multi-process converter. Two destinations, one tensor order (embeddings, layers 0..L-1 with
experts in global order, final norm, lm_head):

``all`` (:func:`export_to_all`)
    Every rank of a TP x PP (x EP) replica receives every tensor: TP shards are all-gathered,
    an expert's owner broadcasts it over the EP group, the owning stage broadcasts to the
    other stages. Colocated engines need this: each GPU's engine worker reads its full
    tensors from its own GPU through CUDA IPC (rollout/sglang/colocated.py).

``controller`` (:func:`export_to_controller`)
    Only global rank 0 yields. On CPU tensors (gloo) only rank 0 receives: Every other rank sends the shards it holds straight to it
    (point-to-point, in the order rank 0 receives them) and holds nothing beyond its
    parameters; rank 0 builds each tensor from the shards. For every consumer that lives on
    the controller: servers it feeds over HTTP, the warm start's evaluator and checkpoint,
    the converter's writer. The ``all`` form would give each of a 32B model's 16 ranks the
    1.5 GiB embedding at once; here one rank holds it. On CUDA tensors the ``all`` export runs
    and the other ranks drop each tensor as it arrives (DESIGN.md, "The controller's export on
    CUDA").

``stages`` (:func:`export_to_controller` with ``per_stage=True``)
    The first rank of each pipeline stage (the lowest global rank with that ``pp_rank``; the
    controller for stage 0) yields its own stage's tensors, built from the shards its stage's
    ranks send it: what a fleet's broadcast groups need, one per stage
    (rollout/fleet/stages.py), with no stage's tensors crossing to another stage. On CUDA
    tensors each stage's source keeps its own stage's part of the ``all`` form (no broadcast
    between stages).

Ranks that hold the same shard (data-parallel and context-parallel copies) send it once:
the lowest global rank holding it is its source, computed identically on every rank from
one all-gather of the layout, so no plan is broadcast.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from megatron_dapo.models import mapping
from megatron_dapo.models.config import HFModelConfig
from megatron_dapo.parallel import ParallelDims, stage_source

__all__ = ["RECEIVERS", "Receivers", "export_to_all", "export_to_controller"]

Receivers = Literal["all", "controller", "stages"]
RECEIVERS: tuple[str, ...] = ("all", "controller", "stages")


def export_to_all(
    hf: HFModelConfig, local: list[mapping.TensorMap], params: Mapping[str, torch.Tensor], dims: ParallelDims,
    *, own_stage: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every rank of the replica receives every tensor (see the module docstring).

    Args:
        hf: the model's parsed HF config.
        local: this rank's tensor maps, mirrors excluded.
        params: this rank's parameters by Megatron name.
        dims: the layout the model was built for.
        own_stage: only this rank's pipeline stage's tensors (no broadcast between stages).

    Yields:
        (HF name, full tensor) on every rank.
    """
    shapes = mapping.expected_hf_shapes(hf)
    dtype = next(iter(params.values())).dtype
    owner = {}  # expert map -> global rank of its EP owner in this rank's EP group
    if dims.ep > 1:
        ep_ranks = dist.get_process_group_ranks(dims.ep_group)
        per_rank: list[list[mapping.TensorMap]] = [[] for _ in range(dims.ep)]
        dist.all_gather_object(per_rank, [tm for tm in local if tm.expert is not None], group=dims.ep_group)
        experts = [(tm, ep_ranks[r]) for r, maps in enumerate(per_rank) for tm in maps]
        owner = {tm.mcore_name + f"@{tm.expert}": src for tm, src in experts}
        local = sorted([tm for tm in local if tm.expert is None] + [tm for tm, _ in experts],
                       key=lambda m: m.sort_key)
    stage_maps: list[list[mapping.TensorMap]] = [local]
    if dims.pp > 1 and own_stage:
        stage_maps = [local if stage == dims.pp_rank else [] for stage in range(dims.pp)]
    elif dims.pp > 1:
        stage_maps = [[] for _ in range(dims.pp)]
        dist.all_gather_object(stage_maps, local, group=dims.pp_group)
    for stage, maps in enumerate(stage_maps):
        for tm in maps:
            src = owner.get(tm.mcore_name + f"@{tm.expert}") if stage == dims.pp_rank else None
            if stage == dims.pp_rank and (src is None or src == dims.rank):
                tensors = _gather_hf(hf, tm, params[tm.mcore_name].detach(), dims)
            else:
                tensors = [torch.empty(shapes[n], dtype=dtype, device=dims.device) for n in tm.hf_names]
            for name, tensor in zip(tm.hf_names, tensors, strict=True):
                if src is not None:
                    tensor = tensor.contiguous()
                    dist.broadcast(tensor, src=src, group=dims.ep_group)
                if dims.pp > 1 and not own_stage:
                    tensor = tensor.contiguous()
                    dist.broadcast(tensor, src=dims.pp_global_ranks[stage], group=dims.pp_group)
                yield name, tensor


def _shard_axis(tm: mapping.TensorMap, dims: ParallelDims) -> tuple[int, int, dist.ProcessGroup | None]:
    """(size, this rank's index, group) of the split a parameter's TP shards follow: TP, or ETP for experts."""
    if tm.expert is None:
        return dims.tp, dims.tp_rank, dims.tp_group
    return dims.etp, dims.etp_rank, dims.etp_group


def _gather_hf(hf: HFModelConfig, tm: mapping.TensorMap, local: torch.Tensor, dims: ParallelDims) -> list[torch.Tensor]:
    size, own, group = _shard_axis(tm, dims)
    if tm.kind == "vocab" and size > 1:
        # Gathered in place: a list of shards and their concatenation would hold the
        # largest tensor (the 1.5 GB embedding of a 32B model) twice on every rank.
        full = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
        if local.device.type == "cpu":  # CPU tensors go over gloo, in any job (DESIGN.md)
            # gloo's all_gather_into_tensor gathers into a flat temporary of the output's size and
            # copies out (ProcessGroupGloo::_allgather_base -> allgather): twice the embedding. A
            # broadcast writes into the tensor it is given, so each shard goes to its own rows.
            sources = dist.get_process_group_ranks(group)
            for index, rows in enumerate(full.split(local.shape[0])):
                if index == own:
                    rows.copy_(local)
                dist.broadcast(rows, src=sources[index], group=group)
        else:
            dist.all_gather_into_tensor(full, local.contiguous(), group=group)
        return [full[: hf.vocab_size]]
    if tm.kind == "replicated" or size == 1:
        shards = [local]
    else:
        shards = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(shards, local.contiguous(), group=group)
    return mapping.hf_from_shards(tm, shards, hf)


@dataclass(frozen=True, slots=True)
class _Shard:
    """One rank's piece of one Megatron parameter, as the layout all-gather describes it."""

    tm: mapping.TensorMap
    index: int
    """Shard index along TP (ETP for experts); 0 for a replicated parameter."""
    count: int
    """Shards that make the parameter (1 when replicated or unsharded)."""
    shape: tuple[int, ...]
    dtype: torch.dtype


def export_to_controller(
    hf: HFModelConfig, local: list[mapping.TensorMap], params: Mapping[str, torch.Tensor], dims: ParallelDims,
    *, per_stage: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Only global rank 0 receives; the other ranks send their shards to it (see the module docstring).

    Collective over the whole job (every rank must iterate it to the end). On ranks other
    than 0 it yields nothing; each sends its parameters as they are (no copies) when rank 0
    reaches them.

    Args:
        hf: the model's parsed HF config.
        local: this rank's tensor maps, mirrors excluded.
        params: this rank's parameters by Megatron name.
        dims: the layout the model was built for.
        per_stage: each pipeline stage's first rank receives its stage's tensors instead
            (``receivers="stages"``); the others yield nothing.

    Yields:
        (HF name, full tensor) on rank 0 only (each stage's first rank with ``per_stage``), in
        export order.
    """
    if dims.device.type != "cpu":
        # Point-to-point only on gloo (DESIGN.md, "The controller's export on CUDA"): on NCCL the
        # proven collective export runs and the other ranks drop what they receive.
        receiver = stage_source(dims, dims.pp_rank) if per_stage else 0
        for item in export_to_all(hf, local, params, dims, own_stage=per_stage):
            if dims.rank == receiver:
                yield item
        return
    # Shapes and dtypes only: a LoRA model's merged view (lora/state.py) would merge each weight to describe it.
    plain = getattr(params, "base", params)
    mine = (dims.pp_rank, [_describe(tm, plain[tm.mcore_name], dims) for tm in local])
    layout: list[tuple[int, list[_Shard]]] = [(0, [])] * dims.world_size
    dist.all_gather_object(layout, mine)
    # Every rank derives the same plan: for each parameter, the lowest rank holding each shard
    # sends it to its receiver (rank 0, or the first rank of the stage that holds it).
    plan: dict[tuple[int, ...], dict[int, tuple[int, _Shard]]] = {}
    stage_of: dict[tuple[int, ...], int] = {}
    for rank, (stage, shards) in enumerate(layout):
        for shard in shards:
            plan.setdefault(shard.tm.sort_key, {}).setdefault(shard.index, (rank, shard))
            stage_of.setdefault(shard.tm.sort_key, stage)
    for key in sorted(plan):
        sources = plan[key]
        first = sources[0][1]
        assert sorted(sources) == list(range(first.count)), f"{first.tm.mcore_name}: shards {sorted(sources)} of {first.count}"
        receiver = stage_source(dims, stage_of[key]) if per_stage else 0
        if dims.rank != receiver:
            for index in range(first.count):
                src, shard = sources[index]
                if src == dims.rank:
                    dist.send(params[shard.tm.mcore_name].detach().contiguous(), dst=receiver)
            continue
        yield from zip(first.tm.hf_names, _receive(hf, [sources[i] for i in range(first.count)], params, dims),
                       strict=True)


def _describe(tm: mapping.TensorMap, param: torch.Tensor, dims: ParallelDims) -> _Shard:
    size, rank, _ = _shard_axis(tm, dims)
    if tm.kind == "replicated" or size == 1:
        size, rank = 1, 0
    return _Shard(tm=tm, index=rank, count=size, shape=tuple(param.shape), dtype=param.dtype)


def _receive(hf: HFModelConfig, sources: list[tuple[int, _Shard]], params: Mapping[str, torch.Tensor],
             dims: ParallelDims) -> list[torch.Tensor]:
    """The receiver: one parameter's shards, its own as they are and the others received, as full HF tensors."""
    tm, shape, dtype = sources[0][1].tm, sources[0][1].shape, sources[0][1].dtype
    me = dims.rank
    if all(src == me for src, _ in sources):
        return mapping.hf_from_shards(tm, [params[shard.tm.mcore_name].detach() for _, shard in sources], hf)
    if tm.kind == "vocab":
        # Received in place, block of rows by block of rows: the embedding exists once on the receiver.
        full = torch.empty((len(sources) * shape[0], *shape[1:]), dtype=dtype, device=dims.device)
        for (src, shard), rows in zip(sources, full.split(shape[0]), strict=True):
            if src == me:
                rows.copy_(params[shard.tm.mcore_name].detach())
            else:
                dist.recv(rows, src=src)
        return [full[: hf.vocab_size]]
    shards = []
    for src, shard in sources:
        if src == me:
            shards.append(params[shard.tm.mcore_name].detach())
        else:
            shards.append(torch.empty(shape, dtype=dtype, device=dims.device))
            dist.recv(shards[-1], src=src)
    return mapping.hf_from_shards(tm, shards, hf)
