"""tools/plan.py against hand calculations for Qwen2.5-32B, its one-line errors, and the sbatch DRY_RUN layout."""

from __future__ import annotations

import glob
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
    Plan,
    format_layout,
    format_plan,
    make_plan,
    rank_groups,
    resolve_model,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG_32B = str(REPO / "examples" / "dapo_qwen2.5_32b.yaml")
H100 = GPUS["h100"]

# Qwen2.5-32B, from its public config.json.
H, F, L, HEADS, KV_HEADS, D, V = 5120, 27648, 64, 40, 8, 128, 152064


def _qwen32b_params_by_hand() -> int:
    q = H * HEADS * D + HEADS * D  # q_proj weight + bias
    kv = 2 * (H * KV_HEADS * D + KV_HEADS * D)  # k_proj, v_proj weights + biases
    o = HEADS * D * H
    mlp = 3 * H * F  # gate, up, down
    norms = 2 * H
    return L * (q + kv + o + mlp + norms) + 2 * V * H + H  # untied embedding + lm_head, final norm


def _plan(overrides: tuple[str, ...] | list[str] = (), nodes: int = 16) -> Plan:
    cfg = load_config(CONFIG_32B, [*overrides, f"trainer.nnodes={nodes}"])
    return make_plan(cfg, resolve_model(cfg), nodes=nodes, gpus_per_node=8, hardware=H100)


def test_qwen32b_param_count_matches_hand_calculation() -> None:
    plan = _plan()
    assert _qwen32b_params_by_hand() == 32_763_876_352
    assert plan.num_params == 32_763_876_352
    assert plan.model.name == "Qwen2.5-32B"


KV_TOKENS_32B = 1_155_931
"""The 32B recipe's KV tokens per engine on an H100 (README and docs quote it)."""


def test_32b_example_fits_on_80gb_at_tp8_pp2() -> None:
    plan = _plan()
    assert (plan.tp, plan.pp, plan.dp, plan.rollout_tp) == (8, 2, 8, 8)
    # Megatron pads V to a multiple of 128 x TP = 1024.
    assert plan.padded_vocab == 152_576
    # Last stage: 32 layers, matrices and biases / TP, two norms replicated, lm_head / TP, final norm.
    layer_sharded = _qwen32b_params_by_hand() - 2 * V * H - H - L * 2 * H
    per_layer_tp = layer_sharded // L // 8 + 2 * H
    local = 32 * per_layer_tp + 152_576 * H // 8 + H
    assert plan.params_per_gpu == local == 2_048_361_472
    # bf16 params 2 + fp32 grads 4 + (fp32 master + Adam m + v) 12 / DP 8.
    assert plan.bytes_per_param == 2 + 4 + 12 / 8
    assert plan.model_state_bytes == local * 7.5
    # Activations per token per layer with SP: (10h + 4 q_dim + 4 kv_dim + 6F) / TP.
    assert plan.act_bytes_per_token_layer == (10 * H + 4 * H + 4 * KV_HEADS * D + 6 * F) / 8 == 30_208
    assert plan.microbatch_tokens == 24_576
    assert plan.activation_bytes == 30_208 * 24_576 * L
    tokens = 24_576
    recompute = 2 * H / 8 * tokens * L + 30_208 * tokens
    assert plan.recompute and plan.activation_recompute_bytes == recompute
    assert plan.logits_bytes == 2 * tokens * 152_576 / 8 * 4
    # KV cache: 2 (K, V) x 64 layers x 8 kv heads / 8 GPUs x 128 x 2 bytes.
    assert plan.kv_bytes_per_token == 2 * 64 * 1 * 128 * 2 == 32_768
    weights = 32_763_876_352 * 2 / 8
    # SGLang keeps 0.7 of the memory free when it starts: the H100's usable 79.6 GiB - the actor's states
    # (Adam's moments included: the run makes them before the engines start) - 4 GiB overhead.
    free_at_start = 79.6 * GIB - local * 7.5 - 4 * GIB
    assert plan.kv_tokens == int((0.7 * free_at_start - weights) // 32_768) == KV_TOKENS_32B
    train = local * 7.5 + recompute + plan.logits_bytes + 3 * 1024 * 152_576 / 8 * 4 + 4 * GIB
    assert plan.train_phase_bytes == pytest.approx(train, rel=1e-12)
    assert round(plan.train_phase_bytes / GIB, 2) == 24.58
    assert plan.rollout_phase_bytes == local * 7.5 + 0.7 * free_at_start + 4 * GIB
    assert round(plan.rollout_phase_bytes / GIB, 2) == 61.21
    assert plan.train_fits and plan.rollout_fits and plan.fits


def test_32b_does_not_fit_at_tp1_pp1() -> None:
    plan = _plan(["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                  "parallel.sequence_parallel=false"])
    assert plan.dp == 128
    # One GPU holds the whole model (V = 152064 is already a multiple of 128).
    assert plan.params_per_gpu == 32_763_876_352
    assert plan.bytes_per_param == 6 + 12 / 128
    assert plan.model_state_bytes / GIB == pytest.approx(185.94, abs=0.005)
    assert plan.model_state_bytes > 80 * GIB
    assert not plan.train_fits and not plan.rollout_fits and not plan.fits


def test_step_time_uses_6n_train_2n_logprob_flops() -> None:
    plan = _plan()
    timing = {line.label: line.value for line in plan.timing}
    tokens = 512 * 16 * (2048 // 8 + 20480 // 4)  # default mean prompt and response lengths
    flops_per_s = 128 * 989e12 * 0.35
    # 16 mini-batches per step: the first one's forward supplies its own old log-probs.
    assert timing["old/ref log-probs"] == pytest.approx(15 / 16 * 2 * 32_763_876_352 * tokens / flops_per_s)
    # Recompute adds a forward (8N); 14 micro-batches per update at PP 2: bubble 1/15.
    assert timing["training"] == pytest.approx(8 * 32_763_876_352 * tokens / flops_per_s / (1 - 1 / 15))
    assert timing["step (sum)"] == pytest.approx(sum(v for k, v in timing.items() if k != "step (sum)"))


def test_model_dims_prefer_the_checkpoints_own_config(tmp_path: Path) -> None:
    ckpt = tmp_path / "Qwen2.5-32B-mine"
    ckpt.mkdir()
    small = json.loads((REPO / "examples/model_configs/Qwen2.5-7B.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(small))
    cfg = load_config(CONFIG_32B, [f"model.hf_checkpoint={ckpt}", "parallel.tensor_model_parallel_size=4",
                                   "parallel.pipeline_model_parallel_size=1", "rollout.tensor_model_parallel_size=4"])
    dims = resolve_model(cfg)
    assert (dims.num_layers, dims.source) == (28, str(ckpt / "config.json"))
    assert resolve_model(load_config(CONFIG_32B, ["model.hf_checkpoint=/x/Qwen2.5-7B-Instruct"])).num_layers == 28
    assert resolve_model(cfg, "qwen2.5-32b").num_layers == 64


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "tools" / "plan.py"), *args], text=True,
                          capture_output=True, timeout=120, cwd=REPO)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "3"], "error: parallel: TP x PP x CP = 8x2x1 = 16 does not divide the world size 24 "
                           "(--nodes 3 x --gpus-per-node 8); launch a multiple of 16 processes or shrink the "
                           "parallel sizes"),
        (["--model-config", "Llama-3-70B"], "error: --model-config='Llama-3-70B': neither a config.json nor a "
                                            "bundled model; use one of Qwen2.5-32B, Qwen2.5-7B, Qwen3-30B-A3B "
                                            "or a path to config.json"),
        (["model.hf_checkpoint=/models/mystery"], "error: model.hf_checkpoint='/models/mystery': no config.json "
                                                  "there and the name matches no bundled model (Qwen2.5-32B, "
                                                  "Qwen2.5-7B, Qwen3-30B-A3B); pass --model-config NAME or a config.json path"),
        (["parallel.tensor_model_parallel_size=16"], "error: parallel.tensor_model_parallel_size=16 does not divide "
                                                     "num_attention_heads=40 of "),
        (["--gpu-mem-gib", "0"], "error: --gpu-mem-gib=0.0: must be a finite number > 0"),
        # Issue 42: accepted, and reported as "-1536 responses" or a plan of a NaN-GiB GPU.
        (["--gpu-mem-gib", "nan"], "error: --gpu-mem-gib=nan: must be a finite number > 0"),
        (["--gpu-mem-gib", "inf"], "error: --gpu-mem-gib=inf: must be a finite number > 0"),
        (["--gen-rounds", "-1"], "error: --gen-rounds=-1.0: must be >= 1"),
        (["--vocab-size", "-5"], "error: --vocab-size=-5: must be a finite number > 0"),
        (["--mfu", "nan"], "error: --mfu=nan: must be in (0, 1]"),
        (["--overhead-gib", "-2"], "error: --overhead-gib=-2.0: must be a finite number >= 0"),
        (["--nodes", "2", "--hosts", "a,b,c", "--layout-only"],
         "error: --hosts names 3 node(s) ('a,b,c') for 2 node(s); give one non-empty name per node"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], message: str) -> None:
    proc = _cli(CONFIG_32B, *args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(message), proc.stderr


def test_cli_prints_formula_and_verdict() -> None:
    proc = _cli(CONFIG_32B, "--nodes", "16", "--gpus-per-node", "8", "--gpu-mem-gib", "80")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "2,048,361,472 params x 7.500 B/param; B/param = 6 + 12/DP = 6 + 12/8" in out
    assert "verdict: FITS on 80 GiB GPUs (79.6 GiB usable)" in out
    assert "model: Qwen2.5-32B from " in out and "(matched from /path/to/Qwen2.5-32B)" in out
    proc = _cli(CONFIG_32B, "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                "parallel.sequence_parallel=false")
    assert proc.returncode == 0 and "verdict: DOES NOT FIT on 80 GiB GPUs" in proc.stdout


def test_rank_groups_match_megatron_rank_generator() -> None:
    from megatron.core.parallel_state import RankGenerator

    for tp, pp, cp, world in [(2, 2, 1, 8), (8, 2, 1, 128), (2, 1, 2, 8), (1, 4, 1, 8)]:
        dp = world // (tp * pp * cp)
        gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        ours = rank_groups(world, tp, pp, cp)
        for name, key in (("TP", "tp"), ("PP", "pp"), ("DP", "dp"), ("CP", "cp")):
            assert ours[name] == sorted(gen.get_ranks(key)), (name, tp, pp, cp, world)


def test_layout_of_a_small_case_exactly() -> None:
    assert format_layout(8, 2, 2, 1, 4, 2, ["a", "b"]).splitlines() == [
        "rank layout: world 8 = TP 2 x CP 1 x DP 2 x PP 2 (Megatron order tp-cp-ep-dp-pp: TP ranks adjacent, "
        "PP outermost)",
        "node 0 a: ranks 0-3: 0(tp0 pp0 dp0) 1(tp1 pp0 dp0) 2(tp0 pp0 dp1) 3(tp1 pp0 dp1)",
        "node 1 b: ranks 4-7: 4(tp0 pp1 dp0) 5(tp1 pp1 dp0) 6(tp0 pp1 dp1) 7(tp1 pp1 dp1)",
        "TP groups (4): [0,1] [2,3] [4,5] [6,7]",
        "PP groups (4): [0,4] [1,5] [2,6] [3,7]",
        "DP groups (4): [0,2] [1,3] [4,6] [5,7]",
        "rollout engine groups (4): [0,1] [2,3] [4,5] [6,7]",
    ]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "MASTER_"))}
    return {**env, "PYTHON": sys.executable, **extra}


def test_sbatch_scripts_parse() -> None:
    scripts = sorted(glob.glob(str(REPO / "slurm" / "*.sbatch")))
    assert [Path(s).name for s in scripts] == ["dapo.sbatch", "dapo_32b.sbatch", "dapo_qwen3_30b_a3b.sbatch",
                                               "dapo_tiny.sbatch"]
    for script in scripts:
        proc = subprocess.run(["bash", "-n", script], text=True, capture_output=True)
        assert proc.returncode == 0, proc.stderr


def test_dry_run_prints_the_layout_and_launches_nothing() -> None:
    env = _clean_env(CONFIG="examples/tiny_cpu.yaml", NNODES="2", GPUS_PER_NODE="2", DEVICE="cpu", DRY_RUN="1")
    proc = subprocess.run(["bash", "slurm/dapo.sbatch", "parallel.pipeline_model_parallel_size=2"], env=env,
                          text=True, capture_output=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    py = sys.executable
    assert proc.stdout.splitlines() == [
        "DRY_RUN: nothing is launched",
        f"repo: {REPO}  master: node0:20000  nodes: node0 node1",
        f"launch: srun --nodes=2 --ntasks-per-node=2 --ntasks=4 --kill-on-bad-exit=1 --label --cpu-bind=none {py} "
        "-m megatron_dapo.train examples/tiny_cpu.yaml trainer.nnodes=2 trainer.n_gpus_per_node=2 trainer.device=cpu "
        "parallel.pipeline_model_parallel_size=2",
        "rank layout: world 4 = TP 1 x CP 1 x DP 2 x PP 2 (Megatron order tp-cp-ep-dp-pp: TP ranks adjacent, "
        "PP outermost)",
        "node 0 node0: ranks 0-1: 0(tp0 pp0 dp0) 1(tp0 pp0 dp1)",
        "node 1 node1: ranks 2-3: 2(tp0 pp1 dp0) 3(tp0 pp1 dp1)",
        "TP groups (4): [0] [1] [2] [3]",
        "PP groups (2): [0,2] [1,3]",
        "DP groups (2): [0,1] [2,3]",
        "rollout engine groups (4): [0] [1] [2] [3]",
    ]
    assert not (REPO / "logs" / "dapo-dryrun").exists()


def test_dry_run_with_apptainer_wraps_each_rank() -> None:
    env = _clean_env(CONFIG="examples/tiny_cpu.yaml", NNODES="1", GPUS_PER_NODE="2", DEVICE="cpu", DRY_RUN="1",
                     APPTAINER_IMAGE="/img/megatron-dapo.sif", APPTAINER_BINDS="/data")
    proc = subprocess.run(["bash", "slurm/dapo.sbatch"], env=env, text=True, capture_output=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[2] == (
        "launch: srun --nodes=1 --ntasks-per-node=2 --ntasks=2 --kill-on-bad-exit=1 --label --cpu-bind=none "
        f"apptainer exec --nv --bind /data --pwd {REPO} /img/megatron-dapo.sif {sys.executable} "
        "-m megatron_dapo.train examples/tiny_cpu.yaml trainer.nnodes=1 trainer.n_gpus_per_node=2 trainer.device=cpu"
    )
    both = subprocess.run(["bash", "slurm/dapo.sbatch"], env={**env, "CONTAINER_IMAGE": "x.sqsh"}, text=True,
                          capture_output=True, timeout=120, cwd=REPO)
    assert both.returncode == 2 and "not both" in both.stderr


def test_dry_run_of_the_32b_script_shows_plan_and_fit() -> None:
    proc = subprocess.run(["bash", "slurm/dapo_32b.sbatch"], env=_clean_env(DRY_RUN="1"), text=True,
                          capture_output=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "rank layout: world 128 = TP 8 x CP 1 x DP 8 x PP 2" in lines[3]
    assert lines[4].startswith("node 0 node0: ranks 0-7: 0(tp0 pp0 dp0) 1(tp1 pp0 dp0)")
    assert lines[19].startswith("node 15 node15: ranks 120-127: 120(tp0 pp1 dp7)")
    assert "verdict: FITS on 80 GiB GPUs (79.6 GiB usable)" in lines


def test_make_plan_reuses_the_configs_world_size_check() -> None:
    cfg = load_config(CONFIG_32B)  # trainer.nnodes 16 x n_gpus_per_node 8
    with pytest.raises(ConfigError, match=r"^trainer.nnodes x trainer.n_gpus_per_node = 16x8 but the launcher "
                                          r"started 120 processes \(--nodes 15 x --gpus-per-node 8\)"):
        make_plan(cfg, resolve_model(cfg), nodes=15, gpus_per_node=8, hardware=H100)


def _megatron_state_bytes() -> dict[str, object]:
    """Bytes of params, grads and optimizer state that megatron-core really allocates, on this rank."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from megatron_dapo import parallel

    dims = parallel.initialize_model_parallel(1, 1, seed=3)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                               normalization="RMSNorm", add_bias_linear=False, bf16=True,
                               params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model = Float16Module(config, GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                                           vocab_size=128, max_sequence_length=16))
    ddp = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True,
                                                 use_distributed_optimizer=True), [ddp])
    tokens = torch.arange(16).view(2, 8) % 128
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(tokens, torch.arange(8).expand(2, 8), None, labels=tokens).float().mean().backward()
    ddp.finish_grad_sync()
    update_ok, _, _ = opt.step()  # Adam's m and v exist after the first step

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    # get_megatron_optimizer returns a ChainedOptimizer over one DistributedOptimizer per buffer group.
    shards = getattr(opt, "chained_optimizers", [opt])
    master = sum(nbytes(p) for o in shards for group in o.shard_fp32_from_float16_groups for p in group)
    adam = sum(nbytes(v) for o in shards for state in o.optimizer.state.values() for k, v in state.items()
               if k in ("exp_avg", "exp_avg_sq"))
    return {
        "dp": dims.dp,
        "num_params": sum(p.numel() for p in ddp.parameters()),
        "param_dtypes": {str(p.dtype) for p in ddp.parameters()},
        "params": sum(nbytes(b.param_data) for b in ddp.buffers),
        "grads": sum(nbytes(b.grad_data) for b in ddp.buffers),
        "grad_dtype": str(ddp.buffers[0].grad_data.dtype),
        "optimizer": master + adam,
        "update_ok": update_ok,
    }


@pytest.mark.multirank
def test_bytes_per_param_is_what_megatron_core_allocates() -> None:
    """The planner's 6 + 12/DP against the buffers of a real DDP + distributed optimizer at DP 2."""
    from dist_utils import run_distributed

    from megatron_dapo.plan import model_state_bytes_per_param

    ranks = run_distributed(_megatron_state_bytes, 2, timeout_s=300)
    expected, formula = model_state_bytes_per_param(bf16=True, distributed_optimizer=True, dp=2)
    assert (expected, formula) == (12.0, "6 + 12/DP = 6 + 12/2")
    total_optimizer = 0
    for r in ranks:
        n = r["num_params"]
        assert (r["dp"], r["param_dtypes"], r["grad_dtype"], r["update_ok"]) == (2, {"torch.bfloat16"},
                                                                                  "torch.float32", True)
        # Buffers are padded for aligned sharding: at most 0.2% over the formula here.
        assert 2 * n <= r["params"] <= 2.002 * n
        assert 4 * n <= r["grads"] <= 4.004 * n
        assert (r["params"] + r["grads"] + r["optimizer"]) / n == pytest.approx(expected, rel=2e-3)
        total_optimizer += r["optimizer"]
    # The two shards hold fp32 master + m + v of every parameter exactly once (plus padding).
    assert 12 * n <= total_optimizer <= 12.01 * n


def test_activations_follow_sequence_and_context_parallel_settings() -> None:
    on, off = _plan(), _plan(["parallel.sequence_parallel=false"])
    # Without SP the 10h replicated part is held whole on every TP rank.
    assert off.act_bytes_per_token_layer == (10 * H * 8 + 4 * H + 4 * KV_HEADS * D + 6 * F) / 8
    assert off.activation_recompute_bytes > on.activation_recompute_bytes
    # CP 2 holds half of each micro-batch's tokens per GPU (and shards the optimizer over dp x cp).
    cp2 = _plan(["parallel.context_parallel_size=2"])
    assert (cp2.cp, cp2.dp) == (2, 4)
    assert cp2.activation_recompute_bytes == on.activation_recompute_bytes / 2
    assert cp2.logits_bytes == on.logits_bytes / 2
    assert format_plan(cp2) != format_plan(on)


def test_step_time_has_no_old_log_prob_pass_for_the_first_mini_batch() -> None:
    # The trainer's own rule (Config.old_log_probs_source): the first update reuses its forward.
    def pass_s(*overrides: str) -> float:
        return {line.label: line.value for line in _plan(list(overrides)).timing}["old/ref log-probs"]

    assert pass_s("trainer.ppo_mini_batch_size=512") == 0.0
    assert pass_s("trainer.ppo_mini_batch_size=512", "trainer.ppo_epochs=2") == 0.0  # epoch 2 reuses epoch 1's
    half = pass_s("trainer.ppo_mini_batch_size=256")
    assert half > 0
    assert pass_s("trainer.ppo_mini_batch_size=128") == pytest.approx(half * 3 / 2)
    assert pass_s("trainer.ppo_mini_batch_size=256", "algorithm.rollout_correction.rollout_is=token") == \
        pytest.approx(half * 2)



@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_plan_help_through_the_cli(flag: str) -> None:
    """`megatron-dapo plan --help` failed ("unrecognized arguments"), and `plan` alone pointed to it."""
    proc = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "plan", flag], text=True, capture_output=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: megatron-dapo plan") and "--gen-rounds" in proc.stdout
    bare = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "plan"], text=True, capture_output=True,
                          timeout=120, cwd=REPO)
    assert bare.returncode == 2 and "(see megatron-dapo plan --help)" in bare.stderr


def sglang_kv_pool_tokens(fraction: float, free_at_start: float, weights: float, cell_bytes: int,
                          page_size: int = 1) -> int:
    """SGLang 0.5.23's `max_total_num_tokens` on one GPU (0 = it refuses to start), written from its
    source as the oracle the planner (RolloutConfig.engine_memory_bytes) is held to.

    rest = free_after_load - free_at_start x (1 - f), free_after_load = free_at_start - weights
    (kv_cache_configurator.py, _profile_available_bytes); tokens = rest // cell, down to a whole
    page (pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes). `cell_bytes` is
    layers x max(1, kv_heads / attn TP) x (head_dim + v_head_dim) x dtype bytes.
    """
    rest = (free_at_start - weights) - free_at_start * (1 - fraction)
    if rest <= 0:
        return 0
    return int(rest // cell_bytes) // page_size * page_size


def test_the_sglang_kv_pool_is_sized_as_sglang_sizes_it() -> None:
    """sglang 0.5.23 (mem_cache/kv_cache_configurator._profile_available_bytes): the pool is
    free_after_load - free_at_start x (1 - f), in whole cells and pages; memory another process
    holds when the server starts shrinks it by f of itself. The planner used f x total memory,
    which for the MoE recipe was five times what SGLang would allocate (issue 39, item 5)."""
    from megatron_dapo.config import RolloutConfig
    from megatron_dapo.plan.model import Assumptions

    # 80 GiB GPU, 30 GiB held by the actor, f = 0.7, 16 GiB of weights, 128 KiB per token:
    # pre = 50, after load 34, slack 50 x 0.3 = 15, rest 19 GiB = 155,648 tokens.
    assert sglang_kv_pool_tokens(0.7, 50 * GIB, 16 * GIB, 128 * 1024) == 155_648
    assert sglang_kv_pool_tokens(0.7, 50 * GIB, 16 * GIB, 128 * 1024, page_size=1000) == 155_000
    # Another 10 GiB held at start: 7 GiB (f x 10) fewer in the pool.
    assert abs(sglang_kv_pool_tokens(0.7, 40 * GIB, 16 * GIB, 128 * 1024) - (155_648 - 7 * 8192)) <= 1
    assert sglang_kv_pool_tokens(0.3, 50 * GIB, 16 * GIB, 128 * 1024) == 0  # "Loaded weights leave no GPU memory"
    sglang = RolloutConfig(engine="sglang", gpu_memory_utilization=0.7)
    assert sglang.engine_memory_bytes(80 * GIB, 30 * GIB) == 0.7 * 50 * GIB
    assert RolloutConfig(engine="vllm", gpu_memory_utilization=0.7, top_p=1.0).engine_memory_bytes(
        80 * GIB, 30 * GIB) == 0.7 * 80 * GIB
    for config in (CONFIG_32B, str(REPO / "examples" / "dapo_qwen3_30b_a3b.yaml")):
        cfg = load_config(config)
        dims = resolve_model(cfg)
        plan = make_plan(cfg, dims, nodes=cfg.trainer.nnodes, gpus_per_node=cfg.trainer.n_gpus_per_node or 8,
                         hardware=H100, assumptions=Assumptions())
        free_at_start = plan.gpu_bytes - plan.model_state_bytes - Assumptions().overhead_gib * GIB
        expected = sglang_kv_pool_tokens(cfg.rollout.gpu_memory_utilization, free_at_start,
                                         plan.rollout_weight_bytes, plan.kv_bytes_per_token)
        assert abs(plan.kv_tokens - expected) <= 1, (config, plan.kv_tokens, expected)
        # The recipes' fractions leave a pool of many full-length sequences per engine.
        assert plan.kv_tokens >= 16 * plan.max_sequence_tokens, (config, plan.kv_tokens)
        assert plan.rollout_phase_bytes <= plan.gpu_bytes
