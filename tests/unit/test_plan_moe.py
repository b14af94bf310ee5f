"""The planner on mixture-of-experts models: Qwen3-30B-A3B by hand, EP sharding, one-line layout errors, the search.

Hand numbers come from the bundled config.json (examples/model_configs/Qwen3-30B-A3B.json,
the HF model card's values) and examples/dapo_qwen3_30b_a3b.yaml on 4 nodes x 8 H100s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError
from megatron_dapo.config.loader import load_config
from megatron_dapo.plan import (
    GIB,
    GPUS,
    ModelDims,
    Plan,
    check_expert_layout,
    format_search,
    make_plan,
    rank_groups,
    resolve_model,
    search_layouts,
    stage_params,
)

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "examples" / "dapo_qwen3_30b_a3b.yaml")
CONFIG_32B = str(REPO / "examples" / "dapo_qwen2.5_32b.yaml")
H100 = GPUS["h100"]

# Qwen3-30B-A3B, from its config.json.
H, L, HEADS, KV_HEADS, D, V = 2048, 48, 32, 4, 128, 151936
E, K, F_MOE = 128, 8, 768
# Per layer: q, k, v, o projections (no biases); two RMSNorms and the q/k norms (d each); the
# router (E x h); E experts of gate, up and down (3 x h x F_moe).
ATTENTION = H * HEADS * D + 2 * H * KV_HEADS * D + HEADS * D * H
REPLICATED = 2 * H + 2 * D + E * H
EXPERT = 3 * H * F_MOE
EMBEDDINGS = 2 * V * H  # untied embedding + lm_head


def _plan(overrides: tuple[str, ...] | list[str] = (), nodes: int = 4, config: str = RECIPE) -> Plan:
    cfg = load_config(config, [*overrides, f"trainer.nnodes={nodes}"])
    return make_plan(cfg, resolve_model(cfg), nodes=nodes, gpus_per_node=8, hardware=H100)


def test_qwen3_30b_a3b_total_and_active_params_by_hand() -> None:
    total = L * (ATTENTION + REPLICATED + E * EXPERT) + EMBEDDINGS + H  # + final norm
    active = L * (ATTENTION + REPLICATED + K * EXPERT) + EMBEDDINGS + H
    assert (total, active) == (30_532_122_624, 3_353_032_704)  # the model card's 30.5 B / 3.3 B activated
    plan = _plan()
    assert plan.model.name == "Qwen3-30B-A3B" and plan.model.qk_norm
    assert plan.model.moe_layers == tuple(range(L))  # decoder_sparse_step 1, mlp_only_layers []
    assert (plan.num_params, plan.num_active_params) == (total, active)


def test_recipe_fits_at_tp2_ep8_by_hand() -> None:
    plan = _plan()
    assert (plan.tp, plan.pp, plan.dp, plan.ep, plan.etp, plan.edp, plan.rollout_tp) == (2, 1, 16, 8, 1, 4, 4)
    assert plan.padded_vocab == 152_064  # multiple of 128 x TP 2
    # Dense part per GPU: attention / TP, norms and router whole on every TP rank, embedding
    # and lm_head / TP, final norm.
    dense = L * (ATTENTION // 2 + REPLICATED) + 2 * 152_064 * H // 2 + H
    experts = L * (E // 8) * EXPERT  # 16 whole experts of every layer
    assert (plan.params_per_gpu, plan.expert_params_per_gpu) == (dense, experts) == (777_205_760, 3_623_878_656)
    # Dense states over DP 16; expert grads are reduced and their optimizer states sharded
    # over the expert data-parallel group, 32 / (EP 8 x ETP 1 x PP 1) = 4.
    assert (plan.bytes_per_param, plan.expert_bytes_per_param) == (6 + 12 / 16, 6 + 12 / 4)
    assert plan.expert_bytes_per_param_formula == "6 + 12/EDP = 6 + 12/4"
    states = dense * 6.75 + experts * 9
    assert plan.model_state_bytes == states
    # Activations of an MoE layer per token: 10h/TP (SP) + (4 q_dim + 4 kv_dim + QK-norm inputs
    # 2 (q_dim + kv_dim) + router 7E + k copies x (2h (ETP + 1) + 6 F_moe)) / TP.
    q, kv = HEADS * D, KV_HEADS * D
    per_token = 10 * H / 2 + (4 * q + 4 * kv + 2 * (q + kv) + 7 * E + K * (2 * H * 2 + 6 * F_MOE)) / 2
    assert plan.moe_act_bytes_per_token_layer == per_token == 75_712
    tokens = 24_576
    assert plan.activation_bytes == per_token * tokens * L
    recompute = 2 * H / 2 * tokens * L + per_token * tokens
    assert plan.recompute and plan.activation_recompute_bytes == recompute
    logits = 2 * tokens * 152_064 / 2 * 4
    chunks = 3 * 1024 * 152_064 / 2 * 4
    dispatch = K * tokens / 2 * (1 + 1) * H * 2  # alltoall send + receive of one layer
    assert (plan.logits_bytes, plan.logprob_chunk_bytes, plan.dispatch_bytes) == (logits, chunks, dispatch)
    train = states + recompute + logits + chunks + dispatch + 4 * GIB
    assert plan.train_phase_bytes == pytest.approx(train, rel=1e-12)
    # SGLang holds all 128 experts of every layer, sharded over its TP 4.
    assert plan.rollout_weight_bytes == 30_532_122_624 * 2 / 4
    assert plan.kv_bytes_per_token == 2 * L * 1 * D * 2  # 4 KV heads / TP 4
    # SGLang keeps 0.8 of what is free beside the actor when it starts (sglang 0.5.23's sizing).
    # What is free then is the H100's usable 79.6 GiB - the actor's states, Adam's moments included (the
    # run makes them before the engines start) - the overhead.
    assert plan.rollout_phase_bytes == states + 0.8 * (79.6 * GIB - states - 4 * GIB) + 4 * GIB
    assert [round(x / GIB, 2) for x in (states, plan.train_phase_bytes, plan.rollout_phase_bytes)] == \
        [35.26, 58.79, 71.53]
    assert plan.fits


def test_flops_use_active_params() -> None:
    plan = _plan()
    timing = {line.label: line.value for line in plan.timing}
    tokens = 512 * 16 * (2048 // 8 + 20480 // 4)
    flops_per_s = 32 * 989e12 * 0.35
    assert timing["training"] == pytest.approx(8 * 3_353_032_704 * tokens / flops_per_s)
    assert timing["old/ref log-probs"] == pytest.approx(15 / 16 * 2 * 3_353_032_704 * tokens / flops_per_s)
    assert "8 x N_active x " in plan.timing[2].formula


def test_ep_divides_expert_memory() -> None:
    base = ["parallel.tensor_model_parallel_size=2", "parallel.expert_tensor_parallel_size=1"]
    plans = {ep: _plan([*base, f"parallel.expert_model_parallel_size={ep}"]) for ep in (1, 2, 4, 8)}
    for ep, plan in plans.items():
        assert plan.expert_params_per_gpu == L * (E // ep) * EXPERT
        assert plan.edp == 32 // ep
        assert plan.expert_bytes_per_param == 6 + 12 / (32 // ep)
        assert plan.params_per_gpu == plans[1].params_per_gpu  # the dense part does not change
    assert plans[1].expert_params_per_gpu == 8 * plans[8].expert_params_per_gpu
    assert not plans[1].fits and plans[8].fits  # 29 B expert params on one GPU: 162 GiB of weights + grads
    # ETP splits each expert instead: EP 4 x ETP 2 holds the bytes EP 8 x ETP 1 does.
    etp2 = _plan(["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=4",
                  "parallel.expert_tensor_parallel_size=2"])
    assert (etp2.expert_params_per_gpu, etp2.edp) == (plans[8].expert_params_per_gpu, 4)
    # PP halves the layers of a stage, and the expert data-parallel group with them.
    pp2 = _plan(["parallel.pipeline_model_parallel_size=2"])
    assert (pp2.expert_params_per_gpu, pp2.edp) == (plans[8].expert_params_per_gpu // 2, 2)


def _dims(**hf: object) -> ModelDims:
    base = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    return ModelDims.from_hf({**base, **hf}, "tiny", "tiny/config.json")


def test_dense_layers_shared_experts_and_pipeline_stages() -> None:
    # Layers 0 and 1 dense (mlp_only_layers), 2 and 3 sparse: stage 1 of PP 2 holds every expert.
    dims = _dims(mlp_only_layers=[0, 1])
    assert dims.moe_layers == (2, 3)
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64
    dense_layer = attention + 2 * 64 + 2 * 16 + 3 * 64 * 96
    sparse_layer = attention + 2 * 64 + 2 * 16 + 8 * 64 + 8 * 3 * 64 * 32
    assert dims.num_params() == 2 * dense_layer + 2 * sparse_layer + 2 * 256 * 64 + 64
    stages = stage_params(dims, tp=1, pp=2, padded_vocab=256, ep=2, etp=1)
    assert [s.experts for s in stages] == [0, 2 * 4 * 3 * 64 * 32]
    assert _dims(decoder_sparse_step=2).moe_layers == (1, 3)
    # A Qwen2-MoE-style shared expert: a TP-sharded SwiGLU of F_s and an h-wide gate per sparse layer.
    shared = _dims(model_type="qwen2_moe", shared_expert_intermediate_size=48, attention_bias=False)
    assert shared.num_params() - _dims(model_type="x").num_params() == 4 * (3 * 64 * 48 + 64)


@pytest.mark.parametrize(
    ("overrides", "nodes", "message"),
    [
        (["parallel.expert_model_parallel_size=3"], 3,
         "error: parallel.expert_model_parallel_size=3 does not divide num_experts=128 of "),
        (["parallel.expert_tensor_parallel_size=2"], 3,
         "error: parallel: EP x ETP x PP = 8x2x1 = 16 does not divide the world size 24 (--nodes 3 x "
         "--gpus-per-node 8); expert groups hold EP x ETP ranks of one pipeline stage: change "
         "expert_model_parallel_size or expert_tensor_parallel_size"),
        (["parallel.sequence_parallel=false"], 4,
         "error: parallel.sequence_parallel=false: a mixture-of-experts model at tensor_model_parallel_size=2 "
         "trains only with sequence parallelism (megatron-core's MoE layer); set parallel.sequence_parallel=true"),
    ],
)
def test_bad_expert_layout_is_one_line(overrides: list[str], nodes: int, message: str) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "plan.py"), RECIPE, *overrides, "--nodes", str(nodes)],
                          text=True, capture_output=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(message), proc.stderr
    if "=3 does not divide" in message:
        assert proc.stderr.rstrip().endswith("; use one of [1, 2, 4, 8, 16, 32, 64, 128]")


def test_expert_parallelism_on_a_dense_model_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^parallel.expert_model_parallel_size=2 needs a mixture-of-experts model, "
                                          r"but .*Qwen2.5-32B.json \(matched from /path/to/Qwen2.5-32B\) is "
                                          r"dense; set it to 1$"):
        _plan(["parallel.expert_model_parallel_size=2"], nodes=16, config=CONFIG_32B)


def test_expert_rules_agree_with_parallel_validate_layout() -> None:
    """check_expert_layout accepts exactly the expert layouts the launcher's validate_layout accepts."""
    import torch

    from megatron_dapo.parallel import validate_layout

    dims = resolve_model(load_config(RECIPE))
    cfg = load_config(RECIPE)
    checked = 0
    for tp in (1, 2):
        for pp in (1, 2):
            for world in (8, 16, 24, 48):
                for ep in (1, 2, 3, 4, 8, 16):
                    for etp in (None, 1, 2, 4):
                        p = dataclasses.replace(cfg.parallel, tensor_model_parallel_size=tp,
                                                pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                                                expert_tensor_parallel_size=etp, sequence_parallel=tp > 1)
                        try:
                            validate_layout(world_size=world, tp=tp, pp=pp, cp=1, device=torch.device("cpu"), ep=ep,
                                            etp=etp, num_experts=E)
                            megatron_ok = True
                        except ValueError:
                            megatron_ok = False
                        try:
                            check_expert_layout(p, dims, world, "test")
                            ours = True
                        except ConfigError:
                            ours = False
                        assert ours == megatron_ok, (tp, pp, world, ep, etp)
                        checked += 1
    assert checked == 2 * 2 * 4 * 6 * 4


def test_world_size_check_catches_a_bad_expert_grid_without_the_model() -> None:
    # What `config validate --world-size` (the sbatch's first check) runs.
    cfg = load_config(RECIPE, ["trainer.nnodes=2", "trainer.n_gpus_per_node=6"])
    with pytest.raises(ConfigError, match=r"^parallel: EP x ETP x PP = 8x1x1 = 8 does not divide the world size 12"):
        cfg.check_world_size(12, "--world-size")
    assert load_config(RECIPE).check_world_size(32, "--world-size") == 16


def test_expert_rank_groups_match_megatron_rank_generator() -> None:
    from megatron.core.parallel_state import RankGenerator

    for tp, pp, ep, etp, world in [(2, 1, 8, 1, 32), (2, 2, 4, 2, 32), (4, 2, 2, 1, 16), (1, 1, 4, 2, 8)]:
        edp = world // (ep * etp * pp)
        gen = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp", rank_offset=0)
        ours = rank_groups(world, tp, pp, 1, ep, etp)
        for name, key in (("EP", "ep"), ("ETP", "tp"), ("EDP", "dp")):
            assert ours[name] == sorted(gen.get_ranks(key)), (name, tp, pp, ep, etp, world)


def test_search_ranks_the_recipes_layout() -> None:
    """With SGLang's pool sized from the memory free beside the actor (sglang 0.5.23), layouts that
    leave more of it free generate with more sequences in flight: the search now ranks deeper
    pipelines first, and the recipe's TP 2 x EP 8 layout (which fits) 43rd. The ranking is the
    planner's model (decode HBM roofline, MFU 0.35), not a measurement."""
    cfg = load_config(RECIPE)
    dims = resolve_model(cfg)
    fitting, planned = search_layouts(cfg, dims, nodes=4, gpus_per_node=8, hardware=H100)
    assert planned == 276 and len(fitting) == 151  # 276: PP 32 at TP 1 too (48 layers: uneven stages)
    best = fitting[0]
    assert (best.tp, best.pp, best.ep, best.etp, best.rollout_tp) == (2, 16, 2, 1, 4)
    assert all(8 % (c.ep * c.etp) == 0 for c in fitting)
    # TP 1 x PP 1 holds 28 GiB of fp32 logits next to 40 GiB of states: never fits.
    assert not [c for c in fitting if (c.tp, c.pp) == (1, 1)]
    assert all(c.plan.fits for c in fitting)
    recipe = make_plan(cfg, dims, nodes=4, gpus_per_node=8, hardware=H100)
    assert recipe.fits
    report = format_search(fitting, planned, recipe)
    lines = report.splitlines()
    assert lines[1].startswith("  1. TP 2 PP 16 EP 2 ETP 1, rollout TP 4: step 1016 s")
    assert "  this config's layout: rank 43 of 151" in lines
    assert lines[-1] == ("recommended: parallel.tensor_model_parallel_size=2 parallel.pipeline_model_parallel_size=16 "
                         "parallel.expert_model_parallel_size=2 parallel.expert_tensor_parallel_size=1 "
                         "parallel.sequence_parallel=true rollout.tensor_model_parallel_size=4")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "MASTER_"))}
    return {**env, "PYTHON": sys.executable, **extra}


def test_dry_run_of_the_moe_script_shows_plan_and_fit() -> None:
    proc = subprocess.run(["bash", "slurm/dapo_qwen3_30b_a3b.sbatch"], env=_clean_env(DRY_RUN="1"), text=True,
                          capture_output=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[2].startswith("launch: srun --nodes=4 --ntasks-per-node=8 --ntasks=32 ")
    assert lines[3].startswith("rank layout: world 32 = TP 2 x CP 1 x DP 16 x PP 1")
    assert lines[4].startswith("expert layout: world 32 = ETP 1 x EP 8 x EDP 4 x PP 1")
    assert lines[5].startswith("node 0 node0: ranks 0-7: 0(tp0 pp0 dp0 ep0) 1(tp1 pp0 dp0 ep1) 2(tp0 pp0 dp1 ep2)")
    assert "EP groups (4): [0,1,2,3,4,5,6,7] [8,9,10,11,12,13,14,15] [16,17,18,19,20,21,22,23] " \
           "[24,25,26,27,28,29,30,31]" in lines
    assert "verdict: FITS on 80 GiB GPUs (79.6 GiB usable)" in lines
    assert "  this config's layout: rank 43 of 151" in lines


def test_bundled_config_is_the_model_cards() -> None:
    hf = json.loads((REPO / "examples" / "model_configs" / "Qwen3-30B-A3B.json").read_text())
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["model_type"] == "qwen3_moe"
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"],
            hf["head_dim"], hf["intermediate_size"], hf["moe_intermediate_size"], hf["num_experts"],
            hf["num_experts_per_tok"], hf["vocab_size"], hf["max_position_embeddings"]) == \
        (2048, 48, 32, 4, 128, 6144, 768, 128, 8, 151936, 40960)
    assert (hf["norm_topk_prob"], hf["decoder_sparse_step"], hf["mlp_only_layers"], hf["tie_word_embeddings"],
            hf["rope_theta"], hf["rms_norm_eps"]) == (True, 1, [], False, 1e6, 1e-6)
    # The actor's own parser accepts it as the planner reads it.
    from megatron_dapo.models import adapter_for

    adapter = adapter_for(hf)
    assert (adapter.hf.family, adapter.hf.num_experts, adapter.hf.moe_layers) == ("qwen3_moe", 128, tuple(range(48)))


def _megatron_expert_state_bytes() -> dict[str, object]:
    """Bytes of dense and expert params, grads and optimizer state megatron-core allocates at EP 2 on 2 ranks."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from megatron_dapo import parallel
    from megatron_dapo.models import moe

    dims = parallel.initialize_model_parallel(1, 1, seed=3, ep=2, num_experts=4)
    moe.ensure_router_fallback()
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                               normalization="RMSNorm", add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
                               pipeline_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
                               num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                               gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    # SwiGLU experts, rotary positions and a tied output layer: the shape ModelDims counts.
    model = Float16Module(config, GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128,
                                           max_sequence_length=16, position_embedding_type="rope",
                                           share_embeddings_and_output_weights=True))
    ddp = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True,
                                                 use_distributed_optimizer=True), [ddp])
    ddp.zero_grad_buffer()
    opt.zero_grad()
    update_ok, _, _ = opt.step()  # Adam's m and v exist after the first step (zero gradients suffice)

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def optimizer_bytes(expert: bool) -> int:
        total = 0
        for o in getattr(opt, "chained_optimizers", [opt]):
            # megatron-core gives the expert-parallel weights (allreduce False) an optimizer of their own.
            if all(getattr(p, "allreduce", True) is False for g in o.model_float16_groups for p in g) is not expert:
                continue
            total += sum(nbytes(p) for g in o.shard_fp32_from_float16_groups for p in g)
            total += sum(nbytes(v) for s in o.optimizer.state.values() for k, v in s.items()
                         if k in ("exp_avg", "exp_avg_sq"))
        return total

    out: dict[str, object] = {"dp": dims.dp, "ep": dims.ep, "update_ok": update_ok}
    for kind, buffers, expert in (("dense", ddp.buffers, False), ("experts", ddp.expert_parallel_buffers, True)):
        out[kind] = {"num_params": sum(p.numel() for p in ddp.parameters() if getattr(p, "allreduce", True) is not expert),
                     "params": sum(nbytes(b.param_data) for b in buffers),
                     "grads": sum(nbytes(b.grad_data) for b in buffers), "optimizer": optimizer_bytes(expert)}
    return out


@pytest.mark.multirank
def test_expert_states_are_what_megatron_core_allocates_at_ep2() -> None:
    """Dense states 6 + 12/DP, expert states 6 + 12/EDP: at world 2 and EP 2 the experts' optimizer is not sharded."""
    from dist_utils import run_distributed

    from megatron_dapo.plan import model_state_bytes_per_param

    ranks = run_distributed(_megatron_expert_state_bytes, 2, timeout_s=300)
    dims = ModelDims(name="tiny", source="test", hidden_size=64, intermediate_size=128, num_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=128,
                     tie_word_embeddings=True, qkv_bias=False, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, moe_layers=(0, 1))
    (stage,) = stage_params(dims, tp=1, pp=1, padded_vocab=128, ep=2, etp=1)
    dense_bpp, _ = model_state_bytes_per_param(True, True, 2)
    expert_bpp, formula = model_state_bytes_per_param(True, True, 1, "EDP")
    assert (dense_bpp, expert_bpp, formula) == (12.0, 18.0, "6 + 12/EDP = 6 + 12/1")
    dense_optimizer = 0
    for r in ranks:
        assert (r["dp"], r["ep"], r["update_ok"]) == (2, 2, True)
        dense, experts = r["dense"], r["experts"]
        # The planner's per-GPU counts: 2 of the 4 experts of both layers; attention, norms, router, tied embedding.
        assert (dense["num_params"], experts["num_params"]) == (stage.dense, stage.experts) == (41_792, 24_576)
        n = experts["num_params"]
        assert 2 * n <= experts["params"] <= 2.002 * n and 4 * n <= experts["grads"] <= 4.004 * n
        # Unsharded (expert data-parallel group of one): each rank holds master + m + v of its own experts.
        assert 12 * n <= experts["optimizer"] <= 12.01 * n
        assert sum(experts[k] for k in ("params", "grads", "optimizer")) / n == pytest.approx(expert_bpp, rel=2e-3)
        dense_optimizer += dense["optimizer"]
    # The dense optimizer states are split over the data-parallel group of 2 (plus alignment padding).
    assert 12 * stage.dense <= dense_optimizer <= 12.02 * stage.dense
