"""Adam's state made at build time is exactly what its first step would make (actor/optimizer_state.py).

The run allocates it before the engines start (tests/e2e/test_engine_start_order.py); this holds
that doing so changes nothing of the update: the same keys, dtypes and devices, and a first and a
second step bit-equal to the lazy optimizer's, for torch's Adam and AdamW in their loop, foreach
and amsgrad forms. megatron-core's wrappers (the distributed optimizer's fp32 shards) are held in
tests/multirank/test_actor_train_step.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.optimizer_state import materialize_optimizer_state, optimizer_state_bytes


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((7, 5), (5,), (0,), (3, 2, 2))]


@pytest.mark.parametrize("kind", ["adam", "adamw", "adamw-foreach", "adamw-amsgrad"])
def test_made_state_steps_bit_equal_to_the_lazy_optimizer(kind: str) -> None:
    def make(params):
        cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
        return cls(params, lr=1e-2, weight_decay=0.1, foreach=kind == "adamw-foreach", amsgrad=kind.endswith("amsgrad"))

    lazy_params, eager_params = _params(0), _params(0)
    lazy, eager = make(lazy_params), make(eager_params)
    made = materialize_optimizer_state(eager)
    numel = sum(p.numel() for p in eager_params)
    moments = 3 if kind.endswith("amsgrad") else 2
    assert made == optimizer_state_bytes(eager) == moments * 4 * numel + 4 * 3  # + a float32 step per non-empty one
    assert optimizer_state_bytes(lazy) == 0
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        grads = [torch.randn(p.shape, generator=gen) for p in lazy_params]
        for params, opt in ((lazy_params, lazy), (eager_params, eager)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()
        for a, b in zip(lazy_params, eager_params, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(lazy_params, eager_params, strict=True):
        sa, sb = lazy.state[a], eager.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and sa[key].device == sb[key].device
            assert torch.equal(sa[key], sb[key])


def test_state_already_there_is_left_alone_and_sgd_without_momentum_needs_none() -> None:
    params = _params(2)
    opt = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params if p.numel()}
    assert materialize_optimizer_state(opt) == 0
    for p in params:
        if p.numel():
            assert all(torch.equal(opt.state[p][k], v) for k, v in before[id(p)].items())
    assert materialize_optimizer_state(torch.optim.SGD(_params(3), lr=0.1)) == 0
