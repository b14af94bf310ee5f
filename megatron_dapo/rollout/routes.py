"""Routed experts per token: what an engine reports for rollout routing replay (issue 26).

An MoE engine routes every token it forwards through the top-k experts of each MoE layer;
the actor can replay exactly those routes (`algorithm.routing_replay=rollout`, R3) so that
its log-probs are computed on the engine's expert choices. An engine reports them per
response as one compact integer array `[P + R - 1, L, k]` (`GenerationResult.routed_experts`):

- rows: every token the engine forwarded, in order: the P prompt tokens, then each response
  token but the last (the last sampled token is never fed back, and nothing reads a route of
  it: the actor's log-probs of a row only use hidden states of earlier positions);
- L: the MoE layers in model order (dense layers have no router and no column);
- k: the expert ids the router chose (`num_experts_per_tok`), in the router's order;
- dtype uint8 for up to 256 experts, else int16 (`route_dtype`): 2 x L x k bytes per token
  at most, never per-token JSON.

A continued partial rollout is prefilled again (prompt + carried tokens) under the new
weights; the routes of those positions are then the new prefill's (the routes the later
tokens' KV cache was computed with), and a response finished before the carry keeps its own.

The local engine reports them always (`HFRouteRecorder` on transformers' Qwen3-MoE routers);
SGLang when asked (`RouteShape`, rollout/sglang/protocol.py); vLLM 0.32 not on a CPU: DESIGN.md,
"Rollout routing replay".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["NO_ROUTE", "HFRouteRecorder", "RouteShape", "perturb_router_choice", "route_dtype", "routes_from_bytes",
           "routes_to_bytes"]

NO_ROUTE = -1
"""Where a batch has no route for a token (padding, a row's last token, an engine without routes)."""


def route_dtype(num_experts: int) -> np.dtype:
    """The compact integer type of expert ids: uint8 up to 256 experts, else int16."""
    if num_experts < 1 or num_experts > 2**15:
        raise ValueError(f"num_experts={num_experts} must be in [1, 32768] to be stored as routes")
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.int16)


@dataclass(frozen=True, slots=True)
class RouteShape:
    """What a server engine's routes look like for one model, and how to turn them into ours."""

    num_layers: int
    """Decoder layers: the engines' layer axis has one column per layer, MoE or not."""
    moe_layers: tuple[int, ...]
    """The MoE layers' 0-based indices: the columns kept (the L axis of our routes)."""
    top_k: int
    """Experts per token."""
    num_experts: int
    """Routed experts per MoE layer (ids are checked against it; fixes the compact dtype)."""

    @classmethod
    def of_checkpoint(cls, model_dir: str | Path) -> RouteShape | None:
        """The shape for an HF checkpoint directory; None for a dense model (no routes)."""
        from megatron_dapo.models import adapter_for

        hf = adapter_for(model_dir).hf
        if not hf.is_moe:
            return None
        return cls(num_layers=hf.num_layers, moe_layers=tuple(hf.moe_layers), top_k=hf.num_experts_per_tok,
                   num_experts=hf.num_experts)

    def ours(self, engine_routes: np.ndarray, rows: int, where: str) -> np.ndarray:
        """An engine's ids as ours: [rows, L_moe, k] in the compact dtype.

        Args:
            engine_routes: the engine's flat or [rows, num_layers, k] integer ids.
            rows: the tokens it forwarded (prompt + response - 1).
            where: names the engine and row in messages.

        Raises:
            ValueError: another size, or an id outside [0, num_experts).
        """
        expected = rows * self.num_layers * self.top_k
        if engine_routes.size != expected:
            raise ValueError(f"{where}: {engine_routes.size} routed-expert ids, expected {rows} tokens x "
                             f"{self.num_layers} layers x top-{self.top_k} = {expected}")
        full = engine_routes.reshape(rows, self.num_layers, self.top_k)[:, list(self.moe_layers)]
        if full.size and (full.min() < 0 or full.max() >= self.num_experts):
            raise ValueError(f"{where}: routed-expert ids outside [0, {self.num_experts}) "
                             f"(min {full.min()}, max {full.max()})")
        return np.ascontiguousarray(full.astype(route_dtype(self.num_experts)))


def routes_to_bytes(routes: np.ndarray) -> dict[str, object]:
    """A JSON-able record of a routes array (checkpointed carried groups): hex bytes, shape, dtype."""
    return {"shape": list(routes.shape), "dtype": routes.dtype.str, "hex": routes.tobytes().hex()}


def routes_from_bytes(record: dict[str, object]) -> np.ndarray:
    """Inverse of routes_to_bytes."""
    data = bytes.fromhex(str(record["hex"]))
    return np.frombuffer(data, dtype=np.dtype(str(record["dtype"]))).reshape(record["shape"]).copy()


class HFRouteRecorder:
    """Records the top-k expert ids of every MoE router of a transformers model, forward by forward.

    transformers 5.19's Qwen3-MoE router (`Qwen3MoeTopKRouter.forward(hidden) -> (logits,
    scores, indices)`, indices [b * s, k] for hidden [b, s, h] flattened row-major) is hooked;
    `take(b, s)` returns the last forward's routes as [b, s, L, k] in the compact dtype.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = hf_routers(model)
        self.num_layers = len(self.routers)
        self.top_k = int(self.routers[0].top_k) if self.routers else 0
        self.dtype = route_dtype(int(self.routers[0].num_experts)) if self.routers else np.dtype(np.uint8)
        self._torch_dtype = torch.uint8 if self.dtype == np.uint8 else torch.int16
        self._last: list[torch.Tensor | None] = [None] * self.num_layers
        self._handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(self.routers)]

    def _hook(self, layer: int):
        def hook(_module: torch.nn.Module, _inputs: tuple, output: tuple) -> None:
            self._last[layer] = output[2].detach().to("cpu", self._torch_dtype)

        return hook

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """Routes of the last forward, [batch, seq, L, k] (the forward's input was [batch, seq])."""
        if any(t is None for t in self._last):
            raise RuntimeError("a router did not run in the last forward; routes are incomplete")
        routes = torch.stack([t.view(batch, seq, self.top_k) for t in self._last], dim=2)  # type: ignore[union-attr]
        self._last = [None] * self.num_layers
        return routes

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def perturb_router_choice(model: torch.nn.Module, std: float, *, seed: int) -> None:
    """Make every MoE router of `model` choose its top-k on logits + N(0, std^2) noise.

    The gates stay the clean model's (softmax of the clean logits at the chosen experts,
    renormalised for norm_topk_prob), so an actor that replays the chosen experts computes
    exactly what this engine computed: the noise stands for kernels that break near-ties
    differently. An experiment's perturbation, never a training setting.
    """
    generator = torch.Generator().manual_seed(seed)
    for router in hf_routers(model):
        def forward(hidden: torch.Tensor, router: torch.nn.Module = router) -> tuple:
            hidden = hidden.reshape(-1, router.hidden_dim)
            logits = torch.nn.functional.linear(hidden, router.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            noise = torch.randn(logits.shape, generator=generator, dtype=torch.float32).to(logits)
            indices = torch.topk(logits + std * noise, router.top_k, dim=-1).indices
            top = probs.gather(-1, indices)
            if router.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), indices

        router.forward = forward


def hf_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of a transformers model in layer order ([] for a dense model)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
