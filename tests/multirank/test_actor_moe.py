"""The actor trains a Qwen3-MoE policy exactly, in every expert-parallel layout, and its checkpoints reshard.

The batch, loss and float64 transformers reference are test_actor_train_step's (6 rows,
shared prompts, every loss term on), on a tiny Qwen3-MoE checkpoint (4 experts top-2,
one dense layer). For each layout (TP, PP, EP) in (1,1,1), (1,1,2), (2,1,2), (1,2,2)
(TP 2 with sequence parallelism: megatron's MoE layer refuses to train without it):
- compute_log_probs equals float64 transformers (< 1e-4);
- one plain SGD step moves every weight, router and experts included, by the float64
  gradient of the whole-batch loss (rel. < 1e-5);
- one AdamW step with the distributed optimizer gives the single-process weights.
Checkpoints: a run at EP 2 saves after its AdamW step (distributed optimizer) and takes a
second step; a single process (EP 1) loads that checkpoint and takes the same second
step with the same weights. The load-balancing loss (model.moe_aux_loss_coeff) adds
exactly coeff x the switch loss E * sum_e f_e P_e of each MoE layer to the gradient.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint
from test_actor_train_step import (
    ADAM,
    LENGTHS,
    LOSS,
    SGD_LR,
    TEMPERATURE,
    _batch_tensors,
    _hf_reference,
    _rel,
)

pytestmark = pytest.mark.multirank

BUDGET = 20  # 2-3 micro-batches per rank
AUX_COEFF = 0.5
AUX_ROWS, AUX_LEN = 3, 10


def _worker(layouts: list[tuple[int, int, int]], directory: str, old: torch.Tensor, ref: torch.Tensor,
            save_to: str | None = None, resume_from: str | None = None, lora_rank: int = 0) -> dict:
    from megatron.core.optimizer import OptimizerConfig

    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch, balance_across_dp
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.checkpoint.manager import CheckpointManager
    from megatron_dapo.config import LoraConfig, OptimConfig
    from megatron_dapo.models import adapter_for

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    t = _batch_tensors()
    full = RolloutBatch(input_ids=t["input_ids"], seq_lens=t["seq_lens"], response_mask=t["response_mask"],
                        old_log_probs=old, advantages=t["advantages"], ref_log_probs=ref)
    loss = LossSettings(**LOSS)
    adapter = adapter_for(directory)
    results: dict = {}
    for tp, pp, ep in layouts:
        dims = parallel.initialize_model_parallel(tp, pp, seed=0, ep=ep, num_experts=adapter.hf.num_experts)
        mine = full.select(balance_across_dp(LENGTHS, dims.dp)[dims.dp_rank])

        def actor(config: OptimizerConfig, dims=dims) -> MegatronActor:
            return MegatronActor(adapter=adapter, dims=dims, optimizer_config=config, hf_checkpoint=directory,
                                 max_tokens_per_microbatch=BUDGET, logprob_chunk_size=7,
                                 sequence_parallel=dims.tp > 1,
                                 lora=LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else None, seed=5)

        def export(a: MegatronActor, dims=dims) -> dict[str, torch.Tensor] | None:
            # Copies: without a TP/PP gather export_hf yields views of the parameters, which the
            # next step would update under the recorded values.
            weights = {n: t.clone() for n, t in adapter.export_hf(a.model, dims)}
            return weights if dims.rank == 0 else None

        out: dict = {"indices": balance_across_dp(LENGTHS, dims.dp)[dims.dp_rank]}
        adam = make_optimizer_config(OptimConfig(**ADAM), dtype=torch.float32, use_distributed_optimizer=True)
        a = actor(adam)
        manager = CheckpointManager(save_to or resume_from or ".", keep_last=0)
        if resume_from is not None:
            manager.load(Path(resume_from) / "step_1", [a.model], a.optimizer, a.scheduler, load_rng=False)
            out["resumed_weights"] = export(a)
        else:
            out["log_probs"], _ = a.compute_log_probs(mine, TEMPERATURE)
            out["metrics"] = a.train_step(mine, loss)
            out["adam_weights"] = export(a)
            if save_to is not None:
                manager.save(1, [a.model], a.optimizer, a.scheduler, {"step": 1}, {}, hf_dir=directory)
        a.train_step(mine, loss)
        out["second_step_weights"] = export(a)
        if resume_from is None:
            sgd = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=SGD_LR, min_lr=SGD_LR, weight_decay=0.0,
                                  clip_grad=0.0, params_dtype=torch.float32, use_distributed_optimizer=False)
            a = actor(sgd)
            a.train_step(mine, loss)
            out["sgd_weights"] = export(a)
        results[(tp, pp, ep)] = out
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("actor_moe") / "qwen3_moe", "qwen3_moe", seed=7)
    # transformers 5.19 runs experts with torch._grouped_mm by default, which refuses float64.
    reference = _hf_reference(directory, experts_implementation="eager")
    ckpt = tmp_path_factory.mktemp("moe_ckpt")
    (single,) = run_distributed(_worker, 1, [(1, 1, 1)], str(directory), reference["old"], reference["ref"])
    return {"dir": str(directory), "hf": reference, "single": single[(1, 1, 1)], "ckpt": str(ckpt)}


def _per_expert(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory fused experts ([E, 2F, H] gate_up_proj, [E, H, F] down_proj) as the
    per-expert tensors of the checkpoint (gate rows first: Qwen3MoeExperts chunks the output in two)."""
    out = {}
    for name, tensor in named.items():
        prefix, _, leaf = name.rpartition(".experts.")
        if leaf == "gate_up_proj":
            for e, fused in enumerate(tensor):
                out[f"{prefix}.experts.{e}.gate_proj.weight"], out[f"{prefix}.experts.{e}.up_proj.weight"] = (
                    fused.chunk(2, dim=0))
        elif leaf == "down_proj":
            for e, down in enumerate(tensor):
                out[f"{prefix}.experts.{e}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out


def _check(out_by_rank: list[dict], layout: tuple[int, int, int], setup: dict) -> dict[str, float]:
    hf, single = setup["hf"], setup["single"]
    errors: dict[str, float] = {"log_prob_abs": 0.0}
    for out in out_by_rank:
        r = out[layout]
        width = r["log_probs"].shape[1]
        valid = torch.zeros(len(r["indices"]), width, dtype=torch.bool)
        for row, i in enumerate(r["indices"]):
            valid[row, 1:LENGTHS[i]] = True
        diff = float((r["log_probs"].double() - hf["log_probs"][r["indices"], :width]).abs()[valid].max())
        errors["log_prob_abs"] = max(errors["log_prob_abs"], diff)
        assert diff < 1e-4, (layout, diff)
    r0 = out_by_rank[0][layout]
    grads, weights = _per_expert(hf["grads/token-mean"]), _per_expert(hf["weights"])
    assert sorted(grads) == sorted(r0["sgd_weights"])
    errors["grad_rel"] = max(_rel((weights[n] - r0["sgd_weights"][n].double()) / SGD_LR, g)
                             for n, g in grads.items())
    assert errors["grad_rel"] < 1e-5, (layout, errors)
    # The routers and experts learn: their gradients are not zero.
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.2.mlp.experts.3.down_proj.weight"):
        assert float(grads[name].norm()) > 1e-6, name
    errors["grad_norm"] = r0["metrics"]["actor/grad_norm"] if "metrics" in r0 else 0.0
    assert abs(errors["grad_norm"] - single["metrics"]["actor/grad_norm"]) < 1e-5, (layout, errors)
    for key in ("adam_weights", "second_step_weights"):
        errors[key] = max(_rel(r0[key][n], single[key][n]) for n in single[key])
        assert errors[key] < 1e-5, (layout, key, errors)
    return errors


def test_single_process_matches_transformers(setup: dict) -> None:
    errors = _check([{(1, 1, 1): setup["single"]}], (1, 1, 1), setup)
    assert errors["log_prob_abs"] < 1e-4 and errors["grad_rel"] < 1e-5, errors


def test_ep2_and_checkpoint_resumes_at_ep1(setup: dict) -> None:
    out = run_distributed(_worker, 2, [(1, 1, 2)], setup["dir"], setup["hf"]["old"], setup["hf"]["ref"],
                          setup["ckpt"], timeout_s=300)
    print((1, 1, 2), _check(out, (1, 1, 2), setup))
    (resumed,) = run_distributed(_worker, 1, [(1, 1, 1)], setup["dir"], setup["hf"]["old"], setup["hf"]["ref"],
                                 None, setup["ckpt"])
    ep2 = out[0][(1, 1, 2)]
    r = resumed[(1, 1, 1)]
    # Experts (saved by their EP owner, read back as one rank's 4 local experts) come back
    # bit-exact; a few dense tensors differ in the last bit (rel. ~1e-8), as the distributed
    # optimizer's fp32 main shards are what the load writes back.
    resumed_err = max(_rel(r["resumed_weights"][n], ep2["adam_weights"][n]) for n in ep2["adam_weights"])
    assert resumed_err < 1e-7, resumed_err
    assert all(torch.equal(r["resumed_weights"][n], ep2["adam_weights"][n]) for n in ep2["adam_weights"]
               if ".experts." in n)
    # The optimizer state came along: the next step is the uninterrupted run's.
    err = max(_rel(r["second_step_weights"][n], ep2["second_step_weights"][n]) for n in ep2["adam_weights"])
    assert err < 1e-5, err


def test_lora_on_experts_at_ep2_equals_ep1_and_its_checkpoint_resumes_at_ep1(setup: dict) -> None:
    """Adapters on every expert (issue 62): an EP owner's experts' adapters, their expert-parallel
    gradients and checkpoint keys (global expert numbers, expert-data-parallel replicas)."""
    args = (setup["dir"], setup["hf"]["old"], setup["hf"]["ref"])
    ckpt = str(Path(setup["ckpt"]).parent / "lora_ckpt")
    (one,) = run_distributed(_worker, 1, [(1, 1, 1)], *args, None, None, 4)
    out = run_distributed(_worker, 2, [(1, 1, 2)], *args, ckpt, None, 4, timeout_s=300)
    (resumed,) = run_distributed(_worker, 1, [(1, 1, 1)], *args, None, ckpt, 4)
    one, ep2, r = one[(1, 1, 1)], out[0][(1, 1, 2)], resumed[(1, 1, 1)]
    moved = [n for n in one["adam_weights"] if ".experts." in n and
             not torch.equal(one["adam_weights"][n], one["second_step_weights"][n])]
    assert moved, "the experts' adapters did not move"
    for key in ("adam_weights", "second_step_weights", "sgd_weights"):
        err = max(_rel(ep2[key][n], one[key][n]) for n in one[key])
        assert err < 1e-5, (key, err)
    assert max(_rel(r["resumed_weights"][n], ep2["adam_weights"][n]) for n in ep2["adam_weights"]) < 1e-7
    err = max(_rel(r["second_step_weights"][n], ep2["second_step_weights"][n]) for n in ep2["adam_weights"])
    assert err < 1e-5, err


def test_four_ranks_tp2xep2_pp2xep2(setup: dict) -> None:
    layouts = [(2, 1, 2), (1, 2, 2)]
    out = run_distributed(_worker, 4, layouts, setup["dir"], setup["hf"]["old"], setup["hf"]["ref"], timeout_s=400)
    for layout in layouts:
        errors = _check(out, layout, setup)
        assert errors["log_prob_abs"] < 1e-4 and errors["grad_rel"] < 1e-5, (layout, errors)


ROUTER_ROWS, ROUTER_LEN = 4, 12  # equal lengths: padded micro-batches without a pad token


def _router_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 100, (ROUTER_ROWS, ROUTER_LEN), generator=g)
    response = torch.zeros(ROUTER_ROWS, ROUTER_LEN, dtype=torch.bool)
    response[:, 5:] = True
    return {"input_ids": ids, "response_mask": response, "advantages": torch.randn(ROUTER_ROWS, ROUTER_LEN, generator=g)}


def _router_worker(layout: tuple[int, int, int], directory: str) -> dict[str, float]:
    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch, balance_across_dp
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.models import adapter_for

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    tp, pp, ep = layout
    adapter = adapter_for(directory)
    dims = parallel.initialize_model_parallel(tp, pp, seed=0, ep=ep, num_experts=adapter.hf.num_experts)
    t = _router_batch()
    full = RolloutBatch(input_ids=t["input_ids"], seq_lens=torch.full((ROUTER_ROWS,), ROUTER_LEN),
                        response_mask=t["response_mask"], advantages=t["advantages"])
    mine = full.select(balance_across_dp([ROUTER_LEN] * ROUTER_ROWS, dims.dp)[dims.dp_rank])
    adam = make_optimizer_config(OptimConfig(**ADAM), dtype=torch.float32, use_distributed_optimizer=True)
    actor = MegatronActor(adapter=adapter, dims=dims, optimizer_config=adam, hf_checkpoint=directory,
                          max_tokens_per_microbatch=2 * ROUTER_LEN, shared_prompts=False, packed=False,
                          sequence_parallel=dims.tp > 1)
    metrics = actor.train_step(mine, LossSettings(), old_from_forward=True)
    return {k: v for k, v in metrics.items() if k.startswith("moe/")}


def _hf_router_metrics(directory: str) -> dict[str, float]:
    """The same statistics from transformers' router logits, one unpadded row at a time."""
    import math

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, experts_implementation="eager")
    k, num_experts = model.config.num_experts_per_tok, model.config.num_experts
    t = _router_batch()
    per_layer: dict[int, list[torch.Tensor]] = {}
    with torch.no_grad():
        for row in t["input_ids"]:
            logits = model(input_ids=row[None], output_router_logits=True).router_logits
            moe_layers = [i for i in range(model.config.num_hidden_layers) if i not in model.config.mlp_only_layers]
            for layer, layer_logits in zip(moe_layers, logits):
                per_layer.setdefault(layer, []).append(layer_logits.reshape(-1, num_experts).float())
    out, ratios, entropies, unused = {}, [], [], 0
    for layer, chunks in per_layer.items():
        logits = torch.cat(chunks)
        counts = torch.zeros(num_experts).index_add_(0, logits.topk(k, dim=-1).indices.flatten(),
                                                      torch.ones(logits.shape[0] * k))
        log_p = torch.log_softmax(logits, dim=-1)
        entropy = float(-(log_p.exp() * log_p).sum(-1).mean()) / math.log(num_experts)
        out[f"moe/load_imbalance/layer_{layer}"] = float(counts.max() / counts.mean())
        out[f"moe/router_entropy/layer_{layer}"] = entropy
        ratios.append(float(counts.max() / counts.mean()))
        entropies.append(entropy)
        unused += int((counts == 0).sum())
    out.update({"moe/load_imbalance": sum(ratios) / len(ratios), "moe/load_imbalance_max": max(ratios),
                "moe/router_entropy": sum(entropies) / len(entropies), "moe/unused_experts": float(unused)})
    return out


def test_routing_metrics_equal_transformers_router_in_every_layout(setup: dict) -> None:
    """moe/* of one update (actor/moe_metrics.py) against transformers' router logits on the
    same tokens, at EP 1 and summed over two ranks at EP 2 (each rank routes its own rows)."""
    expected = _hf_router_metrics(setup["dir"])
    assert len([k for k in expected if "/layer_" in k]) == 3 * 2  # three MoE layers, one dense (layer 1)
    assert expected["moe/load_imbalance_max"] > 1.0 and 0.0 < expected["moe/router_entropy"] < 1.0
    (single,) = run_distributed(_router_worker, 1, (1, 1, 1), setup["dir"])
    ep2 = run_distributed(_router_worker, 2, (1, 1, 2), setup["dir"], timeout_s=300)
    for got in (single, *ep2):
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, got[key], value)
