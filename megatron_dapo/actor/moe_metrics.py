"""Routing metrics of a mixture-of-experts actor: what its users watch to see experts collapse.

During the update's forward passes (train_step), a forward hook on every MoE layer's
router (megatron-core 0.16.1 ``TopKRouter``: ``forward(input) -> (probs, routing_map)``,
``routing_map`` [tokens, E] booleans of the chosen experts) adds up, per layer, the tokens
each expert was given and the entropy of the router's full distribution softmax(logits)
(recomputed from the hook's input and the router's weight, in float32, without a graph).
At the end of the step one all-reduce over every rank sums them: each pipeline stage fills
its own layers, and ranks that see the same tokens (tensor parallelism without sequence
parallelism) add equal copies, which the ratios below do not see.

Metrics (over every token the router saw: prompt, response and packing padding):
- ``moe/load_imbalance/layer_{i}``: max over experts of the tokens given / their mean
  (1 = perfectly balanced, E / k = every token to the same k experts);
  ``moe/load_imbalance`` the mean over MoE layers, ``moe/load_imbalance_max`` the worst;
- ``moe/router_entropy``: mean over layers and tokens of the router's entropy, divided by
  log E (1 = uniform over the experts, 0 = certain), ``moe/router_entropy/layer_{i}`` per layer;
- ``moe/unused_experts``: experts (summed over layers) that got no token this step.
Routing is dropless (no expert capacity is configured), so no token is dropped.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RouterStats"]


class RouterStats:
    """Collects per-layer routing counts and entropies from the routers of one rank's model."""

    def __init__(self, model: torch.nn.Module, *, num_layers: int, num_experts: int, device: torch.device) -> None:
        """Hook every router of `model` (this rank's pipeline stage).

        Args:
            model: the rank's model (the DDP wrapper or the GPTModel).
            num_layers: layers of the whole model (routers name theirs by global layer_number).
            num_experts: E.
            device: where the sums live (the all-reduce's device).
        """
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_layers, self.num_experts = num_layers, num_experts
        self._device = device
        self._collecting = False
        self._reset()
        # layer_number: global and 1-based (TransformerLayer adds the pipeline offset, MoELayer passes it on).
        self._handles = [module.register_forward_hook(self._hook) for module in model.modules()
                         if isinstance(module, TopKRouter)]

    def _reset(self) -> None:
        self._counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=self._device)
        self._entropy = torch.zeros(self.num_layers, dtype=torch.float64, device=self._device)
        self._tokens = torch.zeros(self.num_layers, dtype=torch.float64, device=self._device)

    def _hook(self, router: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not self._collecting:
            return
        layer = router.layer_number - 1
        routing_map = output[1]
        with torch.no_grad():
            hidden = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            bias = router.bias.detach().float() if getattr(router, "bias", None) is not None else None
            logits = torch.nn.functional.linear(hidden, router.weight.detach().float(), bias)
            log_p = torch.log_softmax(logits, dim=-1)
            self._counts[layer] += routing_map.reshape(-1, self.num_experts).sum(0).to(self._counts)
            self._entropy[layer] += -(log_p.exp() * log_p).sum().to(self._entropy)
            self._tokens[layer] += logits.shape[0]

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Count the routers' decisions inside this block only (the update's forward passes)."""
        self._reset()
        self._collecting = True
        try:
            yield
        finally:
            self._collecting = False

    def metrics(self) -> dict[str, float]:
        """Collective over every rank: the step's moe/* metrics (identical on every rank)."""
        sums = torch.cat([self._counts.flatten(), self._entropy, self._tokens])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        counts = sums[: self.num_layers * self.num_experts].view(self.num_layers, self.num_experts)
        entropy = sums[self.num_layers * self.num_experts: -self.num_layers]
        tokens = sums[-self.num_layers:]
        out: dict[str, float] = {}
        imbalance, entropies, unused = [], [], 0
        for layer in range(self.num_layers):
            if tokens[layer] == 0:
                continue  # a dense layer: no router saw a token
            ratio = float(counts[layer].max() / counts[layer].mean())
            mean_entropy = float(entropy[layer] / tokens[layer]) / math.log(self.num_experts)
            out[f"moe/load_imbalance/layer_{layer}"] = ratio
            out[f"moe/router_entropy/layer_{layer}"] = mean_entropy
            imbalance.append(ratio)
            entropies.append(mean_entropy)
            unused += int((counts[layer] == 0).sum())
        if imbalance:
            out["moe/load_imbalance"] = sum(imbalance) / len(imbalance)
            out["moe/load_imbalance_max"] = max(imbalance)
            out["moe/router_entropy"] = sum(entropies) / len(entropies)
            out["moe/unused_experts"] = float(unused)
        return out

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
