"""Adam's state allocated when the actor is built, not at the first step.

torch's Adam/AdamW (`_init_group`), Transformer Engine's FusedAdam (2.11 `step`: `initialize_state`
when a parameter's state is empty) and apex's FusedAdam all create the moments lazily, at the
first `step()`. A colocated SGLang server sizes its memory pool from the memory free when it
starts (sglang 0.5.23 `kv_pool_runtime.py`: the pre-model-load free memory x (1 -
mem_fraction_static), fixed until a restart), and the engines start after the actor is built:
without this, 8 bytes per parameter and data-parallel shard (two fp32 moments) appeared after the
engines had taken their share, and a requeued run's checkpoint load allocated them while SGLang
held its part (DESIGN.md, "Rules where the device ... matters": "The optimizer state exists
before the engines start").

Each parameter gets exactly the state its optimizer's first step would create (the same keys,
dtypes and devices), so the first update is bit-equal with or without this
(tests/unit/test_optimizer_state.py); a parameter whose state exists is left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["inner_optimizers", "materialize_optimizer_state", "optimizer_state_bytes"]

logger = logging.getLogger(__name__)


def inner_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers under a megatron-core optimizer (ChainedOptimizer's parts, each
    wrapper's ``.optimizer``), or `optimizer` itself when it is one; a rank with no parameters
    (an empty shard) has none."""
    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
        return
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(part, "optimizer", None)
        if inner is not None:
            yield from inner_optimizers(inner)


def _init_torch_adam(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> None:
    """torch 2.4-2.13 Adam/AdamW `_init_group`'s lazy state, for one parameter."""
    from torch.optim.optimizer import _get_scalar_dtype

    state = opt.state[p]
    fused = bool(group.get("fused"))
    if group.get("capturable") or fused:
        state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
    else:
        state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def materialize_optimizer_state(optimizer: Any) -> int:
    """Create every parameter's optimizer state now, as its first step would. Returns the bytes made.

    Known optimizers: torch's Adam and AdamW, Transformer Engine's FusedAdam (its own
    ``initialize_state``, master weights and remainders included) and apex's FusedAdam (two
    zero moments; its step count lives in the param group). Any other (SGD, whose momentum
    buffer is made at the first step) is left lazy, with a warning when it keeps state.
    """
    made = 0
    for opt in inner_optimizers(optimizer):
        name = type(opt).__module__ + "." + type(opt).__name__
        is_torch_adam = isinstance(opt, torch.optim.Adam | torch.optim.AdamW)
        is_te = name.startswith("transformer_engine.") and hasattr(opt, "initialize_state")
        is_apex = name.startswith("apex.") and "Adam" in type(opt).__name__
        if not (is_torch_adam or is_te or is_apex):
            if isinstance(opt, torch.optim.SGD) and not any(g.get("momentum") for g in opt.param_groups):
                continue  # stateless
            logger.warning("%s's state is created at its first step, after the engines sized their memory", name)
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                if opt.state.get(p) or p.numel() == 0:
                    continue
                before = _state_bytes(opt.state.get(p, {}))
                if is_torch_adam:
                    _init_torch_adam(opt, group, p)
                elif is_te:
                    opt.initialize_state(p, bool(getattr(opt, "store_param_remainders", False))
                                         and p.dtype == torch.bfloat16)
                else:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
                made += _state_bytes(opt.state[p]) - before
    return made


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors in the optimizer's state now (every inner optimizer's, every parameter's)."""
    return sum(_state_bytes(state) for opt in inner_optimizers(optimizer) for state in opt.state.values())


def _state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
