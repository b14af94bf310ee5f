"""Routing replay is token-exact in every layout (issue 26).

The batch is test_actor_train_step's (6 rows, three shared prompts, right-padded) on a tiny
Qwen3-MoE (4 experts top-2, 4 layers, layer 1 dense: 3 MoE layers). Its "engine routes" are
random top-2 sets, equal on the prompt positions of rows that share a prompt (as an engine
that prefills a prompt once reports them), so replaying them moves the log-probs far from
free routing. Per layout, compute_log_probs with replay:
- equals float64 transformers whose routers are forced to the same experts, each row alone
  (an alignment bug anywhere, a shifted or transposed token, shows as a log-prob gap);
- records, token by token, exactly the replayed experts in every layer
  (record_routes: the routers' own indices mapped back to rows, merged over TP/PP);
- logs moe/replay_route_mismatch 0, in the update (train_step) too.
Free routing recorded (R2) equals transformers' own top-2 of every token, and
moe/router_disagreement is the share of (token, layer) pairs where the random routes differ
from them. Layouts: shared prompts in one and several micro-batches, padded rows, TP 2 + SP,
PP 2, EP 2 (2 processes each).
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint
from test_actor_train_step import LENGTHS, PROMPT_LENGTHS, PROMPT_OF, TEMPERATURE, _batch_tensors

pytestmark = pytest.mark.multirank

NUM_MOE_LAYERS, TOP_K, NUM_EXPERTS = 3, 2, 4


def _routes() -> torch.Tensor:
    """[B, S, L, k] random distinct top-2 ids; prompt positions shared as the prompts are; -1 from each row's last token."""
    g = torch.Generator().manual_seed(5)
    width = max(LENGTHS)
    routes = torch.rand(len(LENGTHS), width, NUM_MOE_LAYERS, NUM_EXPERTS, generator=g).argsort(-1)[..., :TOP_K]
    routes = routes.to(torch.int16)
    for row, (source, plen) in enumerate(zip(PROMPT_OF, PROMPT_LENGTHS, strict=True)):
        routes[row, :plen] = routes[source, :plen]
        routes[row, LENGTHS[row] - 1:] = -1
    return routes


def _worker(variants: list[tuple[int, int, int, bool, int]], directory: str) -> dict:
    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.models import adapter_for

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    t = _batch_tensors()
    adapter = adapter_for(directory)
    results: dict = {}
    for tp, pp, ep, shared, budget in variants:
        dims = parallel.initialize_model_parallel(tp, pp, seed=0, ep=ep, num_experts=adapter.hf.num_experts)
        batch = RolloutBatch(input_ids=t["input_ids"], seq_lens=t["seq_lens"], response_mask=t["response_mask"],
                             advantages=t["advantages"], routes=_routes())
        mine = batch.select(range(len(LENGTHS)))  # DP 1 in every layout here
        actor = MegatronActor(adapter=adapter, dims=dims, hf_checkpoint=directory, shared_prompts=shared,
                              optimizer_config=make_optimizer_config(OptimConfig(lr=1e-4), dtype=torch.float32,
                                                                     use_distributed_optimizer=False),
                              max_tokens_per_microbatch=budget, sequence_parallel=tp > 1, routing_replay="rollout")
        out: dict = {}
        free, _ = actor.compute_log_probs(mine, TEMPERATURE, record_routes=True)
        out["free"], out["free_routes"] = free, mine.replay_routes
        out["free_metrics"] = actor.route_metrics()
        mine.replay_routes = mine.routes
        out["log_probs"], _ = actor.compute_log_probs(mine, TEMPERATURE, replay=True)
        out["replay_metrics"] = actor.route_metrics()
        out["log_probs_recorded"], _ = actor.compute_log_probs(mine, TEMPERATURE, replay=True, record_routes=True)
        out["recorded"] = mine.replay_routes
        mine.replay_routes, mine.old_log_probs = mine.routes, out["log_probs"]
        actor.train_step(mine, LossSettings(temperature=TEMPERATURE), replay=True)
        out["update_metrics"] = actor.route_metrics()
        results[(tp, pp, ep, shared, budget)] = out
    return results


def _hf(directory: str, routes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 transformers, each row alone, its routers forced to `routes` (None = free):
    (log-probs [B, S] aligned like input_ids, its own routes [B, S, L, k])."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, experts_implementation="eager").eval()
    routers = [m for m in model.modules() if isinstance(m, hf_moe.Qwen3MoeTopKRouter)]
    t = _batch_tensors()
    out = torch.zeros(t["input_ids"].shape, dtype=torch.float64)
    own = torch.full((*t["input_ids"].shape, NUM_MOE_LAYERS, TOP_K), -1, dtype=torch.int16)
    forced: list[torch.Tensor | None] = [None]
    seen: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor, layer: int) -> tuple:
        hidden = hidden.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1).to(hidden.dtype)
        top, indices = torch.topk(probs, self.top_k, dim=-1)
        seen.append(indices)
        if forced[0] is not None:
            indices = forced[0][:, layer].long()
            top = probs.gather(-1, indices)
        top = top / top.sum(-1, keepdim=True)
        return logits, top.to(logits.dtype), indices

    for layer, router in enumerate(routers):
        router.forward = (lambda r, i: lambda h: forward(r, h, i))(router, layer)
    with torch.no_grad():
        for row, length in enumerate(LENGTHS):
            ids = t["input_ids"][row, :length]
            if routes is not None:
                forced[0] = routes[row, :length].clamp(min=0)  # the last token: any experts
            seen.clear()
            logits = model(ids[None]).logits[0]
            logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
            out[row, 1:length] = logp[:-1].gather(-1, ids[1:, None])[:, 0]
            own[row, :length] = torch.stack(seen, dim=1).to(torch.int16)
    return out, own


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("replay") / "moe", "qwen3_moe", seed=7)
    forced, _ = _hf(str(directory), _routes())
    free, own = _hf(str(directory), None)
    return {"dir": str(directory), "forced": forced, "free": free, "own": own}


def _same_sets(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor) -> bool:
    return bool((a.sort(-1).values == b.sort(-1).values).all(-1).all(-1)[where].all())


def _check(out: dict, setup: dict, shared_once: bool | None) -> None:
    """shared_once: prompts forwarded once (True), once per row (False), or some split (None: no exact count)."""
    routes = _routes()
    has_route = routes[..., 0, 0] >= 0
    valid = torch.zeros_like(has_route)
    for row, length in enumerate(LENGTHS):
        valid[row, 1:length] = True
    gap = float((out["log_probs"].double() - setup["forced"]).abs()[valid].max())
    assert gap < 1e-4, gap
    away = float((setup["forced"] - setup["free"]).abs()[valid].max())
    assert away > 1e-2, away  # the random routes do change the log-probs
    assert float((out["free"].double() - setup["free"]).abs()[valid].max()) < 1e-4
    assert _same_sets(out["recorded"].long(), routes.long(), has_route), "recorded routes are not the replayed ones"
    assert torch.equal(out["log_probs_recorded"], out["log_probs"])
    assert _same_sets(out["free_routes"].long(), setup["own"].long(), has_route), "R2 records the free routes"
    differs = ~(routes.long().sort(-1).values == setup["own"].long().sort(-1).values).all(-1)  # [B, S, L]
    # Over the (token, layer) pairs the model forwarded: a prompt shared in one micro-batch once.
    counted = has_route.clone()
    if shared_once is None:
        assert 0.5 < out["free_metrics"]["moe/router_disagreement"] < 1.0
    elif shared_once:
        for row, (source, plen) in enumerate(zip(PROMPT_OF, PROMPT_LENGTHS, strict=True)):
            counted[row, :plen] &= source == row
    expected = float(differs[counted].double().mean())
    assert shared_once is None or abs(out["free_metrics"]["moe/router_disagreement"] - expected) < 1e-9, expected


# (tp, pp, ep, shared prompts, token budget) on 2 processes (one spawn: CI time); TP 1 x PP 1
# x EP 1 is then DP 2 with the whole batch on each rank. Budget 200 holds the batch in one
# micro-batch, 30 and 20 cut it into 3 and 5 (a shared prompt split over micro-batches is
# forwarded, and counted, twice: shared_once None).
LAYOUTS = {(1, 1, 1, True, 200): True, (1, 1, 1, True, 20): None, (1, 1, 1, False, 200): False,
           (2, 1, 1, True, 200): True, (1, 2, 1, False, 30): False, (1, 1, 2, False, 200): False}


def test_replay_is_token_exact_with_shared_prompts_padded_rows_tp2_sp_pp2_ep2(setup: dict) -> None:
    out = run_distributed(_worker, 2, list(LAYOUTS), setup["dir"], timeout_s=400)
    assert [sorted(rank_out) for rank_out in out] == [sorted(LAYOUTS)] * 2  # every layout ran on both ranks
    for variant, shared_once in LAYOUTS.items():
        for rank_out in out:
            _check(rank_out[variant], setup, shared_once=shared_once)
            # The forwards of the old-log-prob pass and the update used exactly the replayed routes.
            assert rank_out[variant]["replay_metrics"]["moe/replay_route_mismatch"] == 0.0
            assert rank_out[variant]["update_metrics"]["moe/replay_route_mismatch"] == 0.0


def _recompute_worker(variants: list[tuple[int, int, str, bool]], directory: str) -> dict:
    """Per (pp, budget, recompute, replay): this rank's parameters after one update, and the route metrics."""
    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.models import adapter_for

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    t = _batch_tensors()
    adapter = adapter_for(directory)
    results: dict = {}
    for pp, budget, recompute, replay in variants:
        dims = parallel.initialize_model_parallel(1, pp, seed=0, num_experts=adapter.hf.num_experts)
        batch = RolloutBatch(input_ids=t["input_ids"], seq_lens=t["seq_lens"], response_mask=t["response_mask"],
                             advantages=t["advantages"], routes=_routes())
        mine = batch.select(range(len(LENGTHS)))
        actor = MegatronActor(adapter=adapter, dims=dims, hf_checkpoint=directory, recompute=recompute,
                              optimizer_config=make_optimizer_config(OptimConfig(lr=1e-2), dtype=torch.float32,
                                                                     use_distributed_optimizer=False),
                              max_tokens_per_microbatch=budget, routing_replay="rollout")
        mine.replay_routes = mine.routes
        mine.old_log_probs, _ = actor.compute_log_probs(mine, TEMPERATURE, replay=True)
        actor.route_metrics()
        stats = actor.train_step(mine, LossSettings(temperature=TEMPERATURE), replay=replay)
        results[(pp, budget, recompute, replay)] = {
            "params": [p.detach().clone() for p in actor.model.parameters()],
            "metrics": actor.route_metrics(), "grad_norm": stats.get("actor/grad_norm")}
    return results


def test_the_recomputed_forward_replays_the_forwards_routes_at_pp1_and_pp2(setup: dict) -> None:
    """Under full recompute the update is the one without recompute, replayed routes and all.

    The random routes move the log-probs far from free routing, so an update whose backward
    recomputed the layers with free routes would differ: the replayed update with recompute must
    equal the replayed one without, and differ from the free one. PP 2 with 3 micro-batches runs
    1F1B (two forwards before the first backward): each backward's recompute takes its own
    micro-batch's routes.
    """
    variants = [(pp, budget, recompute, replay) for pp, budget in ((1, 200), (1, 30), (2, 30))
                for recompute, replay in (("none", True), ("full", True), ("none", False))]
    out = run_distributed(_recompute_worker, 2, variants, setup["dir"], timeout_s=400)
    for rank_out in out:
        for pp, budget in ((1, 200), (1, 30), (2, 30)):
            plain, recomputed = rank_out[(pp, budget, "none", True)], rank_out[(pp, budget, "full", True)]
            free = rank_out[(pp, budget, "none", False)]
            assert recomputed["metrics"]["moe/replay_route_mismatch"] == 0.0  # forward and recompute both
            for a, b in zip(plain["params"], recomputed["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            moved = max(float((a - b).abs().max()) for a, b in zip(plain["params"], free["params"], strict=True))
            assert moved > 1e-4, moved  # the replayed routes do change the update
