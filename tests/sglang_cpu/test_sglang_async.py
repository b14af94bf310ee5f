"""The asynchronous loop on SGLang's own CPU server (sglang 0.5.18): weights arrive mid-stream.

DESIGN.md "The asynchronous loop": a weight update pauses generation in place, loads the
buckets, sets the version and continues; rows in flight are neither aborted nor waited for,
and each reports the versions its tokens came from. The server-level rule (a 0.5.18 update
without the pause waits for every request in flight: the model's writer lock) is held on the
fleet module's first server (test_sglang_fleet.py); the trainer test here runs the tiny run with
rollout.placement=disaggregated on a fleet of two. Its kill -9 run stays a run of its own: its
resumed first batch must hold no carried group (the float32 gap of the resumed weights), and the
fleet run carries groups at every step, which a checkpoint keeps and that batch would continue.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_utils import TINY_SHAPE
from tiers import requires, sglang_missing

pytestmark = [
    pytest.mark.sglang_cpu,
    pytest.mark.e2e,
    *requires(sglang_missing()),
]

SHAPE = {**TINY_SHAPE, "hidden_size": 128, "max_position_embeddings": 4096}
NUM_TOKENS = 1500  # long enough that the update lands mid-row on 2 cores


def make_checkpoint(directory: Path, seed: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, num_hidden_layers=2, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                         eos_token_id=None, bos_token_id=None))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(str(directory))
    return directory


def test_the_asynchronous_loop_runs_on_a_fleet_of_two_sglang_servers_within_the_bound(tmp_path):
    """Issue 41's fleet on CPU: two servers the controller started, weights by one gloo broadcast per
    bucket to both, the same versions on both after every sync; streaming dynamic sampling across
    both servers with partial rollouts, no response older than the bound (its oldest token)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from trainer_utils import REPO, read_rows, run_trainer

    out = tmp_path / "run"
    proc = run_trainer(REPO / "examples" / "tiny_cpu.yaml", "rollout.engine=sglang", "rollout.placement=disaggregated",
                       "rollout.num_engines=2", "trainer.max_staleness=1", "algorithm.rollout_correction.rollout_is=token",
                       # 40 SFT steps teach the scratch model to stop at different lengths (without them
                       # every response runs to the cap, groups end together and none is left to carry).
                       "model.sft_warm_start.num_steps=40", "model.sft_warm_start.batch_size=16",
                       "reward.reward_fn=e2e_reward_fns:char_parity", "rollout.partial_rollout=true",
                       "data.train_batch_size=4", "data.gen_batch_size=8", "trainer.ppo_mini_batch_size=4",
                       # No held-out evaluation (test_freq 20 ran two, ~5 s each, checked by nothing here).
                       "trainer.save_interval=100", "trainer.test_freq=0", "trainer.total_training_steps=3",
                       f"trainer.output_dir={out}", cache_dir=tmp_path / "cache", timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in read_rows(out) if "async/staleness_max" in r]
    assert [r["train/num_responses"] for r in rows] == [32, 32, 32]
    assert all(r["async/staleness_max"] <= 1 for r in rows), rows
    assert all(r["train/kept_group_acc_min"] > 0 for r in rows)  # dynamic sampling kept only groups with spread
    assert sum(r["rollout/carried_groups"] for r in rows) > 0  # the full batch's abort left groups to continue
    # Step 1 trains version 0's batch; a later step trains one generated ahead, under older weights.
    assert rows[0]["async/staleness_max"] == 0
    assert max(r["async/staleness_max"] for r in rows[1:]) == 1
    # Two servers the controller started, never released: the colocated hand-over did not run; the
    # weights came by broadcast, one group for the run, and both took every version.
    assert sorted(p.name for p in (out / "engine_logs").iterdir()) == ["sglang0.log", "sglang1.log"]
    logs = [(out / "engine_logs" / f"sglang{i}.log").read_text() for i in range(2)]
    for log in logs:
        assert "release_memory_occupation" not in log and "disable_radix_cache=True" in log
        assert "sleep_on_idle=True" in log  # an idle scheduler waits on its sockets, not spinning a core
        assert log.count("POST /init_weights_update_group HTTP/1.1\" 200") == 1
        assert "POST /update_weights_from_tensor" not in log
    updates = [log.count("POST /update_weights_from_distributed HTTP/1.1\" 200") for log in logs]
    versions = [log.count("POST /update_weight_version HTTP/1.1\" 200") for log in logs]
    assert updates[0] == updates[1] > 0 and versions[0] == versions[1] >= 3, (updates, versions)


def test_a_fleet_run_killed_9_ahead_of_the_actor_resumes_losing_and_repeating_nothing(tmp_path):
    """Issue 41: "resume after kill -9 loses and repeats no step or prompt, as today", on a fleet.
    The trainer is SIGKILLed once step 2 is logged, its producer a step ahead on the server; the
    same command again starts a fresh server and loads the resumed weights into it by broadcast
    before it serves: the resumed run's first batch, generated under them (staleness 0, no partial
    rollouts to carry), has the engine/actor gap of float32, not that of the checkpoint the server
    was started from. No step or prompt is lost or repeated, no process of either run is left."""
    import json
    import re
    import subprocess
    import sys
    import uuid

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from trainer_utils import (
        REPO,
        kill_main_when,
        read_rows,
        run_processes,
        step_logged,
        train_command,
        trainer_env,
    )

    out = tmp_path / "run"
    command = train_command(REPO / "examples" / "tiny_cpu.yaml", "rollout.engine=sglang",
                            "rollout.placement=disaggregated", "rollout.num_engines=1", "trainer.max_staleness=1",
                            "algorithm.rollout_correction.rollout_is=token", "model.sft_warm_start.num_steps=40",
                            "model.sft_warm_start.batch_size=16", "reward.reward_fn=e2e_reward_fns:char_parity",
                            "data.train_batch_size=4", "data.gen_batch_size=8", "trainer.ppo_mini_batch_size=4",
                            "trainer.test_freq=0", "trainer.save_interval=1", "trainer.total_training_steps=4",
                            f"trainer.output_dir={out}")
    env = {**trainer_env(tmp_path / "cache"), "FAULT_TEST_TAG": uuid.uuid4().hex}
    kill_main_when(command, env, tmp_path / "a.log", step_logged(out, 2), timeout_s=900)  # also: nothing left
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = re.search(r"resumed from \S+ at step (\d+)", proc.stderr)
    assert resumed is not None, proc.stderr[-4000:]
    rows = [r for r in read_rows(out) if "async/staleness_max" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4], [r["step"] for r in rows]
    assert all(r["async/staleness_max"] <= 1 for r in rows), rows
    # A response generated ahead, under the weights before the update, differs from the actor by
    # the update itself; one generated under the weights the actor holds, by float32 rounding.
    first = rows[int(resumed.group(1))]  # the resumed run's first step
    for row in (rows[0], first):
        assert row["async/staleness_hist/0"] == 1.0, row
        assert row["rollout/train_logprob_abs_diff"] < 1e-4, row
    state = json.loads((out / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    sampler = state["sampler"]
    drawn = sampler["epoch"] * sampler["num_records"] + sampler["position"]
    assert drawn == sum(int(r["train/num_prompts_taken"]) for r in rows)
    assert run_processes(env["FAULT_TEST_TAG"]) == []
