"""`megatron-dapo plan --engine-nodes K` (plan/fleet.py) against hand calculations for Qwen2.5-32B, and its one-line errors."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from megatron_dapo.config.loader import load_config
from megatron_dapo.plan import (
    GIB,
    GPUS,
    FleetPlan,
    SyncLink,
    main,
    make_fleet_plan,
    make_plan,
    resolve_model,
    stage_sync_bytes,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG_32B = str(REPO / "examples" / "dapo_qwen2.5_32b.yaml")
CONFIG_MOE = str(REPO / "examples" / "dapo_qwen3_30b_a3b.yaml")
H100 = GPUS["h100"]

# Qwen2.5-32B (test_plan.py checks the count against its config.json by hand).
N, H, L, V, F = 32_763_876_352, 5120, 64, 152_064, 27_648
LAYER = 487_605_248  # one layer's parameters (the planner prints L x 487,605,248)
PEAK, MFU, HBM, HBM_EFF = 989e12, 0.35, 3350e9, 0.7


def _fleet(overrides: tuple[str, ...] | list[str] = (), nodes: int = 8, engine_nodes: int = 4,
           link: SyncLink | None = None) -> FleetPlan:
    cfg = load_config(CONFIG_32B, [*overrides, f"trainer.nnodes={nodes}"])
    return make_fleet_plan(cfg, resolve_model(cfg), nodes=nodes, engine_nodes=engine_nodes, gpus_per_node=8,
                           hardware=H100, link=link)


def test_sync_bytes_are_the_whole_model_in_bf16_split_by_stage() -> None:
    plan = _fleet()
    assert plan.colocated.num_params == N
    assert plan.sync_bytes == 2 * N == 65_527_752_704
    # PP 2: 32 layers each; stage 0 adds embed_tokens (V x h, unpadded), the last lm_head (V x h) and the final norm.
    assert plan.stage_sync_bytes == (2 * (32 * LAYER + V * H), 2 * (32 * LAYER + V * H + H))
    # One NDR port at 0.8, the two stages in turns (a server takes one bucket at a time,
    # rollout/fleet/stages.py): the whole model's bytes set the time.
    w = plan.seconds("W weight sync")
    assert w == pytest.approx(2 * N / (50e9 * 0.8), rel=1e-12)
    assert w == pytest.approx(1.6382, abs=1e-4)
    # Twice the link's speed halves it.
    assert _fleet(link=SyncLink(gbps=100)).seconds("W weight sync") == pytest.approx(w / 2, rel=1e-12)


def test_stage_bytes_sum_to_the_model_for_moe_uneven_and_tied_models() -> None:
    cfg = load_config(CONFIG_MOE)
    moe = resolve_model(cfg)
    for pp in (1, 4, 5, 7):
        assert sum(stage_sync_bytes(moe, pp)) == 2 * moe.num_params()
    tied = dataclasses.replace(moe, tie_word_embeddings=True)
    # HF holds one vocab matrix when tied: stage 0 sends it, the last stage only the final norm beyond its layers.
    assert sum(stage_sync_bytes(tied, 3)) == 2 * tied.num_params() == 2 * (moe.num_params() - moe.vocab_size * moe.hidden_size)


def test_engine_gpu_memory_on_gpus_of_its_own() -> None:
    plan = _fleet()
    assert (plan.num_engines, plan.rollout_tp, plan.engine_gpus, plan.actor_gpus) == (4, 8, 32, 32)
    weights = N * 2 / 8
    assert plan.engine_weight_bytes == weights == 8_190_969_088
    # SGLang keeps 0.7 of the memory free when it starts: all but the 4 GiB overhead (no actor states here).
    static = 0.7 * (79.6 * GIB - 4 * GIB)  # the H100's usable 79.6 GiB
    assert plan.engine_static_bytes == pytest.approx(static, rel=1e-12)
    assert plan.kv_bytes_per_token == 2 * L * (8 // 8) * 128 * 2 == 32_768
    assert plan.kv_tokens == int((static - weights) // 32_768) == 1_484_114
    assert plan.engine_bytes == pytest.approx(static + 4 * GIB, rel=1e-12)
    assert round(plan.engine_bytes / GIB, 2) == 56.92
    # 6144 responses per engine, mean sequence 256 + 5120: as many at once as the pool holds.
    assert plan.concurrent == 1_484_114 // 5376 == 276
    assert plan.engine_fits

    tp4 = _fleet(["rollout.tensor_model_parallel_size=4"])
    assert (tp4.num_engines, tp4.kv_bytes_per_token) == (8, 2 * L * 2 * 128 * 2)
    assert tp4.kv_tokens == int((static - N * 2 / 4) // 65_536) == 617_072
    assert tp4.engine_fits
    # TP 1: 61 GiB of weights above SGLang's 53.2 GiB share: it would refuse to start.
    tp1 = _fleet(["rollout.tensor_model_parallel_size=1"])
    assert tp1.refusal is not None and tp1.kv_tokens == 0 and not tp1.engine_fits and not tp1.fits
    assert any("refuse to start" in w for w in tp1.warnings)


def test_actor_gpus_hold_the_actor_alone() -> None:
    plan = _fleet()
    a = plan.actor
    assert (a.world_size, a.tp, a.pp, a.dp) == (32, 8, 2, 2)
    states = 2_048_361_472 * (6 + 12 / 2)
    assert a.model_state_bytes == states
    # The train phase as make_plan computes it (no engine share enters it); the sync phase adds to the states
    # the largest tensor a TP 8 source gathers (V_pad x h = 152576 x 5120 x 2 B) and one 512 MiB bucket.
    assert plan.actor_sync_phase_bytes == states + 152_576 * H * 2 + 512 * 2**20 + 4 * GIB
    assert plan.actor_fits and plan.fits
    # At TP 1 a source rank sends its own stage's tensors as they are: nothing gathered, only the bucket.
    tp1 = _fleet(["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false"])
    assert tp1.export_bytes == 0
    assert tp1.actor_sync_phase_bytes == tp1.actor.model_state_bytes + 512 * 2**20 + 4 * GIB
    assert not tp1.actor_fits  # 16 B params at 6 + 12/16 B each


def _generation_by_hand(engines: int, tp: int, kv_tokens: int) -> float:
    prompt, response = 2048 // 8, 20480 // 4
    responses = 1536 * 16
    per_engine = math.ceil(responses / engines)
    concurrent = min(per_engine, kv_tokens // (prompt + response))
    steps = max(math.ceil(per_engine / concurrent) * response, 20480)
    kv = concurrent * (prompt + response / 2) * 2 * L * max(1, 8 // tp) * 128 * 2
    mem = (N * 2 / tp + kv) / (HBM * HBM_EFF)
    compute = 2 * N * concurrent / (tp * PEAK * MFU)
    return steps * max(mem, compute) + 2 * N * responses * prompt / (engines * tp * PEAK * MFU)


def _update_by_hand(gpus: int, dp: int) -> float:
    tokens = 512 * 16 * (256 + 5120)
    flops = gpus * PEAK * MFU
    micro_batches = math.ceil(32 * 16 * 5376 / dp / 24_576)
    bubble = 1 / (micro_batches + 1)  # PP 2
    return 15 / 16 * 2 * N * tokens / flops + 8 * N * tokens / flops / (1 - bubble)


def test_split_step_is_the_max_of_generation_and_update_plus_sync() -> None:
    plan = _fleet()
    g, u, w = plan.seconds("G(N_e) generation"), plan.seconds("U(N_a) update"), plan.seconds("W weight sync")
    assert g == pytest.approx(_generation_by_hand(4, 8, plan.kv_tokens), rel=1e-12)
    assert u == pytest.approx(_update_by_hand(32, 2), rel=1e-12)
    assert g > u + w  # 4 engines for 24,576 responses: generation sets the pace
    assert plan.seconds("split step") == g
    assert plan.seconds("split, staleness 0") == pytest.approx(g + u + w)
    colocated = make_plan(load_config(CONFIG_32B, ["trainer.nnodes=8"]), plan.actor.model, nodes=8, gpus_per_node=8,
                          hardware=H100)
    assert plan.seconds("colocated step") == colocated.step_seconds == plan.colocated.step_seconds
    assert plan.seconds("colocated / split") == pytest.approx(colocated.step_seconds / g)

    # Six engine nodes, the actor on two (DP 1): now the update and the sync set the pace.
    wide = _fleet(engine_nodes=6)
    g, u, w = (wide.seconds(k) for k in ("G(N_e) generation", "U(N_a) update", "W weight sync"))
    assert wide.num_engines == 6 and wide.actor.dp == 1
    assert u == pytest.approx(_update_by_hand(16, 1), rel=1e-12)
    assert g < u + w
    assert wide.seconds("split step") == pytest.approx(u + w)


def test_a_disaggregated_config_keeps_its_engine_count() -> None:
    plan = _fleet(["rollout.placement=disaggregated", "rollout.num_engines=2", "trainer.max_staleness=1",
                   "algorithm.rollout_correction.rollout_is=token"])
    assert plan.disaggregated and plan.num_engines == 2 and plan.max_staleness == 1
    assert plan.warnings == ["rollout.num_engines=2 x TP 8 uses 16 of the 32 engine GPUs; rollout.num_engines=4 "
                             "uses them all"]
    assert plan.seconds("G(N_e) generation") == pytest.approx(_generation_by_hand(2, 8, plan.kv_tokens), rel=1e-12)


def test_cli_prints_the_split(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([CONFIG_32B, "--nodes", "8", "--engine-nodes", "4", "--no-search"]) == 0
    out = capsys.readouterr().out
    assert "disaggregated split: --engine-nodes 4 of 8 nodes x 8 GPUs: actor 32 GPUs (TP 8 PP 2 CP 1 DP 2)" in out
    assert "  engine GPU           56.92 GiB  weights + KV pool + overhead: fits in 79.6 GiB" in out
    assert "weight sync: 61.03 GiB per sync = N x 2 B" in out
    assert "  W weight sync           1.64 s  sum over the PP 2 stage(s)" in out
    assert "split verdict: FITS" in out
    assert out.index("verdict: FITS on 80 GiB GPUs (79.6 GiB usable)") < out.index("disaggregated split")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine-nodes", "8"], "error: --engine-nodes=8 of --nodes 8: must be in [1, 7]"),
        (["--engine-nodes", "0"], "error: --engine-nodes=0 of --nodes 8: must be in [1, 7]"),
        (["--engine-nodes", "1", "rollout.tensor_model_parallel_size=5"],
         "error: rollout.tensor_model_parallel_size=5 must divide the 8 engine GPUs (--engine-nodes 1 x "
         "--gpus-per-node 8) and num_attention_heads=40"),
        (["--engine-nodes", "1", "rollout.placement=disaggregated", "rollout.num_engines=2"],
         "error: rollout.num_engines x rollout.tensor_model_parallel_size = 2x8 = 16 GPUs, more than the 8 engine "
         "GPUs (--engine-nodes 1 x --gpus-per-node 8); lower rollout.num_engines to 1 or raise --engine-nodes to 2"),
        (["--engine-nodes", "3"], "error: parallel: TP x PP x CP = 8x2x1 = 16 does not divide the world size 40 "
                                  "(the actor's 5 node(s): --nodes 8 - --engine-nodes 3, x --gpus-per-node 8)"),
        (["--engine-nodes", "4", "--sync-gbps", "nan"], "error: --sync-gbps=nan: must be a finite number > 0"),
        (["--engine-nodes", "4", "--sync-efficiency", "0"], "error: --sync-efficiency=0.0: must be in (0, 1]"),
        (["--engine-nodes", "4", "--layout-only"], "error: --engine-nodes=4 plans the split's memory"),
    ],
)
def test_bad_splits_exit_2_with_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([CONFIG_32B, "--nodes", "8", "--no-search", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith(message), err
