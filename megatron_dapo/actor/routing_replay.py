"""Routing replay on the actor's MoE routers: R3 (the engine's routes) and R2 (the old policy's).

megatron-core 0.16.1 reads replayed routes through one hook: `topk_routing_with_score_function`
calls `router.router_replay.get_replay_topk(scores, topk, num_groups, group_topk,
default_compute_topk)` whenever `TopKRouter.router_replay` is set, and takes the indices it
returns (probabilities: `scores.gather(1, indices)`, then the usual softmax over the k for
`moe_router_pre_softmax=false`). megatron's own `RouterReplay` object is not used: it
registers every instance in one process-global list (the actor, the frozen reference and
every model a test builds, never released), its backward replay (for activation recompute)
is switched by nobody in megatron-core, and its `set_target_indices` keeps every target it
was ever given. `LayerReplay` is that hook for one router of this model, fed per micro-batch
by `RouteReplay.prepare` with exactly the tokens that router sees (actor/route_layout.py).

While a batch has engine routes, every forward pass also measures, per (token, MoE layer)
with a route:
- disagreement: the router's own top-k set differs from the engine's (computed from the
  scores the router got, so with replay on it is conditional on the replayed earlier layers);
- mismatch: the experts the forward dispatched (the router's output `routing_map`, after the
  hook) differ from the replayed ones: must be 0 (a router that did not replay, a fused
  router kernel that ignores the hook, ...).
Recording (R2): the routes the old-log-prob pass used are written back to rows (the inverse
map) and merged over TP (SP shards), CP and PP (each stage its layers) with one MAX all-reduce.

Under full activation recompute (`model.recompute_activations`, megatron's uniform method) a
layer's forward runs twice: once inside `CheckpointFunction.forward` (grad disabled, activations
dropped) and again in its backward (`torch.enable_grad()`, tensor_parallel/random.py). megatron-core
0.16.1 switches no router to replaying in that second forward, which would route afresh. Here each
router keeps, per forward of a pass that recomputes, the experts it returned (replayed or its own)
in a FIFO; a call with grad enabled in such a pass is the recompute, and takes the oldest entry.
Megatron's schedules run a stage's backwards in the order of its forwards (no pipelining: each
right after its forward; 1F1B at PP>1: micro-batch i's backward before i+1's), so the entry is
that micro-batch's, and the recomputed forward dispatches exactly what the forward did, replay or
not, at any PP size (one model chunk; virtual pipeline stages are refused by the adapter). The
recompute's dispatch is checked like the forward's (`moe/replay_route_mismatch`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.actor.microbatch import MicroBatch
from megatron_dapo.actor.route_layout import local_positions, model_order_targets, rows_from_model_order
from megatron_dapo.parallel import ParallelDims
from megatron_dapo.rollout.routes import NO_ROUTE

__all__ = ["LayerReplay", "RouteReplay"]


class LayerReplay:
    """megatron's `router_replay` hook of one MoE router: replays, records and compares routes."""

    def __init__(self, owner: RouteReplay, moe_index: int) -> None:
        self.owner = owner
        self.moe_index = moe_index
        """Position of this layer among the model's MoE layers (the L axis of routes)."""
        self.forwards: deque[tuple[torch.Tensor, torch.Tensor | None]] = deque()
        """Under recompute: (experts returned [T, k], tokens replayed [T] or None) per forward not yet recomputed."""
        self.dispatched: tuple[torch.Tensor, torch.Tensor] | None = None
        """The replayed experts of the current call and the tokens they hold for, for the dispatch check."""

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None,
                        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron's top-k, or the replayed indices with their scores ([T, k] each)."""
        probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        owner = self.owner
        self.dispatched = None
        if not owner.active:
            return probs, indices
        if owner.recompute and torch.is_grad_enabled():  # the backward's second forward
            if not self.forwards:
                raise RuntimeError(f"MoE layer {self.moe_index}: a recomputed forward without its forward; "
                                   "routing replay cannot tell which routes it took")
            indices, has = self.forwards.popleft()
            if has is not None:
                self.dispatched = (indices, has)
            return scores.gather(1, indices), indices
        if owner.engine is not None:
            targets, has = owner.engine[0][:, self.moe_index], owner.engine[1]
            differs = (indices.sort(-1).values != targets.sort(-1).values).any(-1) & has
            owner.sums[0] += differs.sum()
            owner.sums[1] += has.sum()
        replayed = None
        if owner.replay is not None:
            indices, replayed = owner.replay[0][:, self.moe_index], owner.replay[1]
            probs = scores.gather(1, indices)
            self.dispatched = (indices, replayed)
        if owner.recorded is not None:
            owner.recorded[:, self.moe_index] = indices
        if owner.recompute:
            self.forwards.append((indices, replayed))
        return probs, indices


class RouteReplay:
    """Routing replay, recording and route metrics for one rank's model (its pipeline stage)."""

    def __init__(self, model: torch.nn.Module, *, moe_layers: tuple[int, ...], top_k: int, dims: ParallelDims,
                 sequence_parallel: bool) -> None:
        """Hook every TopKRouter of `model`.

        Args:
            model: this rank's model (DDP wrapper or GPTModel).
            moe_layers: 0-based global indices of the model's MoE layers (HFConfig.moe_layers).
            top_k: experts per token.
            dims: this rank's layout.
            sequence_parallel: whether the routers see a 1 / tp sequence shard.
        """
        from megatron.core.transformer.moe.router import TopKRouter

        self.layers: list[LayerReplay] = []
        self.recompute = False
        """The model recomputes every layer's forward in its backward (full recompute)."""
        self.top_k = top_k
        self.num_layers = len(moe_layers)
        self.dims = dims
        self.sequence_parallel = sequence_parallel
        self.active = self._replaying = self._recording = self._comparing = False
        # (token, layer) pairs: disagreeing, compared with the engine, mismatched, replayed. On the
        # model's device: the hooks run in every router's forward and must not wait for the GPU.
        self.sums = torch.zeros(4, dtype=torch.float64, device=dims.device)
        self.engine: tuple[torch.Tensor, torch.Tensor] | None = None
        self.replay: tuple[torch.Tensor, torch.Tensor] | None = None
        self.recorded: torch.Tensor | None = None
        self._positions = torch.zeros(0, dtype=torch.long)
        self._handles = []
        for module in model.modules():
            if isinstance(module, TopKRouter):
                if module.config.moe_router_fusion:
                    raise ValueError("routing replay needs megatron's unfused router (moe_router_fusion=False): "
                                     "the fused kernel never calls the replay hook")
                if module.config.recompute_granularity == "full":
                    if module.config.recompute_method != "uniform":
                        raise ValueError("routing replay under full recompute needs megatron's uniform method "
                                         f"(got {module.config.recompute_method!r}): every layer recomputed")
                    self.recompute = True
                module.router_replay = LayerReplay(self, moe_layers.index(module.layer_number - 1))
                self.layers.append(module.router_replay)
                self._handles.append(module.register_forward_hook(self._check_dispatch))

    def _check_dispatch(self, router: Any, _inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Count (token, layer) pairs whose dispatched experts are not the replayed ones."""
        layer: LayerReplay = router.router_replay
        if not self.active or layer.dispatched is None:
            return
        routing_map = output[1].reshape(-1, output[1].shape[-1])  # [T, E] bool
        targets, has = layer.dispatched
        layer.dispatched = None
        wanted = torch.zeros_like(routing_map).scatter_(1, targets, True)
        self.sums[2] += ((routing_map != wanted).any(-1) & has).sum()
        self.sums[3] += has.sum()

    @contextlib.contextmanager
    def pass_(self, *, replay: bool, record: bool, compare: bool = True) -> Iterator[None]:
        """One pass over micro-batches: replay their replay_routes, record what the routers used,
        and (compare) count where the routers' own top-k differs from the engine's routes: only
        meaningful while the weights are those that generated the batch."""
        self.active, self._replaying, self._recording, self._comparing = True, replay, record, compare
        self._forget_forwards()
        try:
            yield
        finally:
            self.active = self._replaying = self._recording = False
            self.engine = self.replay = self.recorded = None
            self._forget_forwards()

    def _forget_forwards(self) -> None:
        """Drop the experts kept for recompute (a forward-only pass keeps entries nothing takes)."""
        for layer in self.layers:
            layer.forwards.clear()
            layer.dispatched = None

    def prepare(self, mb: MicroBatch) -> None:
        """Before a micro-batch's forward: the targets of the tokens this rank's routers see.

        `engine` (the engine's routes, compared with the router's own top-k) and `replay` (what
        the routers return instead): each ([T_local, L, k] int64, has_route [T_local]) or None.
        """
        if not self.active:
            return
        self._positions = self._local(mb)

        def local(routes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
            if routes is None:
                return None
            targets, has = model_order_targets(mb, routes, self.num_layers, self.top_k)
            return targets[self._positions], has[self._positions]

        self.engine = local(mb.routes) if self._comparing else None
        self.replay = None
        if self._replaying:
            if mb.replay_routes is None and mb.indices:
                raise ValueError("routing replay is on but the batch has no routes to replay")
            self.replay = local(mb.replay_routes) or local(torch.full((*mb.targets.shape, self.num_layers, self.top_k),
                                                                      NO_ROUTE, device=mb.input_ids.device))
        self.recorded = None
        if self._recording:
            self.recorded = torch.full((self._positions.numel(), self.num_layers, self.top_k), NO_ROUTE,
                                       dtype=torch.long, device=mb.input_ids.device)

    def _local(self, mb: MicroBatch) -> torch.Tensor:
        d = self.dims
        return local_positions(tuple(mb.input_ids.shape), cp=d.cp, cp_rank=d.cp_rank, tp=d.tp, tp_rank=d.tp_rank,
                               sequence_parallel=self.sequence_parallel).to(mb.input_ids.device)

    def recorded_rows(self, mb: MicroBatch) -> torch.Tensor:
        """After a micro-batch's forward: what this rank's routers used, as rows [n, S, L, k] (-1 elsewhere)."""
        full = self.recorded.new_full((mb.input_ids.numel(), self.num_layers, self.top_k), NO_ROUTE)
        full[self._positions] = self.recorded
        return rows_from_model_order(mb, full)

    def merge_recorded(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's recorded routes merged (MAX over -1): SP shards, CP chunks, PP stages' layers."""
        d = self.dims
        merged = rows.to(torch.int32)
        for size, group in ((d.tp, d.tp_group), (d.cp, d.cp_group), (d.pp, d.pp_group)):
            if size > 1:
                dist.all_reduce(merged, op=dist.ReduceOp.MAX, group=group)
        return merged.to(torch.int16)

    def metrics(self) -> dict[str, float]:
        """Collective over every rank: the counts since the last call, as moe/* metrics; then reset."""
        sums = self.sums.clone()
        self.sums.zero_()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        sums = sums.cpu()
        # Ranks that see the same tokens (TP without SP) add equal copies, which ratios do not see.
        out = {}
        if sums[1] > 0:
            out["moe/router_disagreement"] = float(sums[0] / sums[1])
        if sums[3] > 0:
            out["moe/replay_route_mismatch"] = float(sums[2] / sums[3])
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
