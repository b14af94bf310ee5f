"""The trainer with rollout.engine=vllm on vLLM's own CPU server, its server killed mid-generation.

A short run of examples/tiny_cpu.yaml (the scratch model without the warm start, as the SGLang
tier's runs, streaming dynamic sampling on a verifier that needs no skill) holds what a step through vLLM must: the colocated hand-over (sleep,
wake, sync with a version), the engine/actor gap at the float32 level at every step, and a
restart in place (issue 31): the server's process group is SIGKILLed while step 2 generates
(after step 1, once one of step 2's requests was answered, with the rest in flight), the
controller relaunches it with the weights of the last sync and sends the lost requests again,
and the run goes on with no step lost or repeated. That the vLLM run learns as the local
engine's does is measured on the full example (docs/benchmarks.md, 2026-11-22: +20.7 points
against +21.9 over 160 steps); the 30-step learning run that held it here cost CI 10 minutes.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest
from tiers import requires, vllm_missing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from trainer_utils import REPO, kill_engine_when, read_rows, step_logged, train_command, trainer_env

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.e2e,
    *requires(vllm_missing()),
]

# Streaming dynamic sampling stays on (a kill mid-stream once ended a step with none of its groups,
# DESIGN.md); char_parity gives the scratch model's groups spread without the warm start. test_freq 0:
# any test_freq > 0 still evaluates before step 1 and after the last (512 responses each), which no
# run here checks (held-out evaluation on a server: test_sglang_server.py's eval command, tests/e2e).
SHORT = ("rollout.engine=vllm", "model.sft_warm_start.enable=false", "reward.reward_fn=e2e_reward_fns:char_parity",
         "trainer.save_interval=100", "data.train_batch_size=8", "data.gen_batch_size=8",
         "trainer.ppo_mini_batch_size=8", "trainer.test_freq=0")
ANSWERED = '/inference/v1/generate HTTP/1.1" 200'
"""vLLM's access log line of one answered request."""


def kill_while_step_2_generates(command: list[str], tmp_path: Path, out: Path) -> tuple[int, int]:
    """Run the trainer and SIGKILL its vLLM server once step 1 is logged and one of the next step's
    requests was answered (the rest in flight). Returns the trainer's exit code and the last step
    logged at the kill: 1, or 2 when step 2's generation was over before the poll saw step 1 logged
    (CI 2026-12-02 under two suites at once: restarts [0, 0, 1])."""
    engine_log = out / "engine_logs" / "vllm0.log"
    after_step_1 = step_logged(out, 1)
    answered: list[int] = []
    logged_at_kill: list[int] = []

    def generating_step_2() -> bool:
        if not answered:
            if not after_step_1():
                return False
            answered.append(engine_log.read_text(errors="replace").count(ANSWERED))
        if engine_log.read_text(errors="replace").count(ANSWERED) <= answered[0]:
            return False
        logged_at_kill.append(max(r["step"] for r in read_rows(out) if "rollout/train_logprob_abs_diff" in r))
        return True

    code = kill_engine_when(command, trainer_env(tmp_path / "cache"), tmp_path / "trainer.log", generating_step_2,
                            marker="vllm.entrypoints.openai.api_server", timeout_s=900)
    assert len(logged_at_kill) == 1, f"the server was killed {len(logged_at_kill)} times"
    return code, logged_at_kill[0]


def test_a_vllm_server_killed_mid_generation_costs_a_restart_and_the_gap_stays_at_float32_level(tmp_path):
    """The actor is a LoRA one with the merged sync (issue 62): the server takes W + (alpha/r) B A
    through the same resharded sync as a full model's weights (lora/state.py's merged view of the
    export), so the gap and the restart hold for both; the adapter-only sync is test_vllm_lora.py's."""
    out = tmp_path / "run"
    command = train_command(REPO / "examples" / "tiny_cpu.yaml", *SHORT, f"trainer.output_dir={out}",
                            "trainer.total_training_steps=3", "model.lora.rank=4", "model.lora.alpha=8",
                            "optim.lr=2e-3")
    log = tmp_path / "trainer.log"
    engine_log = out / "engine_logs" / "vllm0.log"
    code, killed_after = kill_while_step_2_generates(command, tmp_path, out)
    assert code == 0, log.read_text()[-4000:]
    rows = [r for r in read_rows(out) if "rollout/train_logprob_abs_diff" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]  # no step repeated, none lost
    assert [r["train/num_responses"] for r in rows] == [64, 64, 64]  # the lost requests were sent again
    assert killed_after in (1, 2), killed_after  # a later step's generation was interrupted
    assert [r["rollout/engine_restarts"] for r in rows] == [int(r["step"] > killed_after) for r in rows]
    # Engine (vLLM, fp32) vs actor log-probs of the same tokens at every step: the restarted
    # server serves the last sync's weights, not the checkpoint it was started from.
    assert max(r["rollout/train_logprob_abs_diff"] for r in rows) < 1e-4, rows
    text = engine_log.read_text(errors="replace")
    assert text.count("Starting vLLM server on") == 2  # one log, both lives
    assert "model.lora: rank 4, alpha 8 on linear_qkv" in log.read_text()  # the actor is a LoRA one
    # Merged: every sync sends the whole model (3.3 MB in float32), not the adapters.
    assert all(r["sync/num_bytes"] >= 3_318_272 for r in rows), [r["sync/num_bytes"] for r in rows]


FINISHED = 'POST /finish_weight_update HTTP/1.1" 200'
"""vLLM's access log line of one finished weight update (the version set)."""


def test_a_fleet_of_two_vllm_servers_runs_the_asynchronous_loop_within_the_bound_through_a_kill(tmp_path):
    """Issue 41's vLLM fleet on CPU: two servers the controller started, weights by gloo broadcast
    through our transfer engine, streaming dynamic sampling across both with partial rollouts at
    max_staleness 1 and token TIS; one server is SIGKILLed once step 1 is logged (its rows go to
    the other meanwhile), restarted in place and loaded alone by its fleet before it serves; no
    step lost or repeated, no response older than the bound. The actor runs TP 1 x PP 2 on two
    ranks: each stage's first rank broadcasts its own stage's buckets in a group of its own
    (fleet/stages.py), and the groups are formed again with the restarted server. (That the
    stages' bytes land right is held by the fleet tests with real servers, test_vllm_fleet.py and
    test_sglang_fleet.py, and tests/multirank/test_export_receivers.py.)"""
    out = tmp_path / "run"
    command = train_command(
        REPO / "examples" / "tiny_cpu.yaml", "rollout.engine=vllm", "rollout.placement=disaggregated",
        "rollout.num_engines=2", "trainer.max_staleness=1", "algorithm.rollout_correction.rollout_is=token",
        # The scratch model as is (no warm start): char_parity gives its groups spread. (Carrying groups
        # across steps is held by the SGLang fleet's run and the e2e async run, which warm-start for it.)
        "model.sft_warm_start.enable=false", "reward.reward_fn=e2e_reward_fns:char_parity", "rollout.partial_rollout=true", "data.train_batch_size=4",
        "data.gen_batch_size=8", "trainer.ppo_mini_batch_size=4", "trainer.save_interval=100", "trainer.test_freq=0",
        "trainer.total_training_steps=3", "parallel.pipeline_model_parallel_size=2", f"trainer.output_dir={out}",
        nproc=2)  # fmt: skip
    log = tmp_path / "trainer.log"
    # The product's placement of a fleet (the suite's per-worker binding would be a user's, and win).
    env = {k: v for k, v in trainer_env(tmp_path / "cache").items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    code = kill_engine_when(command, env, log, step_logged(out, 1),
                            marker="vllm.entrypoints.openai.api_server", timeout_s=900)
    assert code == 0, log.read_text()[-4000:]
    rows = [r for r in read_rows(out) if "train/num_responses" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Every forming of the fleet's groups had stage 1's beside the controller's (restarts form them again).
    formed = re.findall(r"weight broadcast group \S+: 2 servers, world size 3, gloo, (\d+) pipeline stage", log.read_text())
    assert len(formed) >= 2 and set(formed) == {"1"}, formed
    assert [r["train/num_responses"] for r in rows] == [32, 32, 32]
    # Every step's responses report their versions (a continued one too), so the bound was checked.
    assert all("async/staleness_max" in r for r in rows), rows
    assert all(r["async/staleness_max"] <= 1 for r in rows), rows
    assert rows[0]["async/staleness_max"] == 0 and max(r["async/staleness_max"] for r in rows[1:]) == 1
    # Step 1 trains version 0's batch, on both servers: engine and actor agree at the float32 level.
    assert rows[0]["rollout/train_logprob_abs_diff"] < 1e-4, rows[0]
    # The killed server only (a kill that lands in a broadcast restarts both: every member's weights
    # are then partly updated).
    assert 1 <= rows[-1]["rollout/engine_restarts"] <= 2, rows
    assert sorted(p.name for p in (out / "engine_logs").iterdir()) == ["vllm0.log", "vllm1.log"]
    logs = [(out / "engine_logs" / f"vllm{i}.log").read_text(errors="replace") for i in range(2)]
    # The killed server restarted (its log holds both lives); when the kill landed in a sync, the
    # broadcast failed and every member was stopped and restarted (2026-11-28: seen both ways).
    lives = [text.count("Starting vLLM server on") for text in logs]
    assert sorted(lives) in ([1, 2], [2, 2]) and sum(lives) - 2 == rows[-1]["rollout/engine_restarts"], (lives, rows)
    for text in logs:
        # Weights by our broadcast backend only, never released; every finished update resumed (but
        # one a kill cut between the two); the first life joined both groups (the controller's, stage 1's).
        assert "megatron_dapo_broadcast" in text and "POST /sleep" not in text
        assert text.count('POST /init_weight_transfer_engine HTTP/1.1" 200') >= 2
        finished, resumed = text.count(FINISHED), text.count('POST /resume HTTP/1.1" 200')
        assert finished >= 3 and 0 <= finished - resumed <= 1, (finished, resumed)
    # Each server's worker is bound to cores of its own (cpu_fleet_binding): vLLM's default binding
    # put both servers of a fleet on the same core (DESIGN.md "A CPU fleet's servers get cores ...").
    bound = [set(re.findall(r"core ids=\[([0-9, ]+)\]", text)) for text in logs]
    assert all(len(b) == 1 for b in bound) and bound[0] != bound[1], bound
    cores = [{int(c) for c in b.pop().split(",")} for b in bound]
    assert not cores[0] & cores[1], cores


def test_a_trainer_killed_mid_broadcast_takes_its_fleet_with_it(tmp_path):
    """Issue 41: the controller SIGKILLed (MEGATRON_DAPO_FAULT=broadcast:0:kill, no cleanup runs) once
    its server joined the group and its first broadcast began (that bucket may still arrive, gloo
    sending on its own thread; no other does). Nothing hangs: every server process
    (API server, engine core, worker in the gloo group) is gone within 15 s, by its reaper (lifetime.py).
    A fleet of one server: the reaper is per server, and a second one cost CI 40 s (two servers hold
    the fleet's other kill, in the loop test above)."""
    import re
    import subprocess
    import time

    from proc_utils import alive

    out = tmp_path / "run"
    command = train_command(REPO / "examples" / "tiny_cpu.yaml", "rollout.engine=vllm",
                            "rollout.placement=disaggregated", "rollout.num_engines=1", "trainer.max_staleness=1",
                            "algorithm.rollout_correction.rollout_is=token", "model.sft_warm_start.enable=false",
                            "rollout.update_weights_bucket_megabytes=1", "trainer.total_training_steps=1",
                            f"trainer.output_dir={out}")
    log = tmp_path / "trainer.log"
    env = {**trainer_env(tmp_path / "cache"), "MEGATRON_DAPO_FAULT": "broadcast:0:kill"}
    with log.open("w") as sink:
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        assert proc.wait(timeout=600) == -9, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "rank 0: injected fault at the start of broadcast" in log.read_text()
    text = (out / "engine_logs" / "vllm0.log").read_text(errors="replace")
    # It had joined the group and the kill came in the first bucket's broadcast: gloo sends on a
    # thread of its own once the broadcast is enqueued, so that one bucket may have arrived before
    # the SIGKILL (CI saw it once in 2026-11-29's run), never a second one, and the update never ended.
    assert 'POST /init_weight_transfer_engine HTTP/1.1" 200' in text, text[-2000:]
    assert text.count('POST /update_weights HTTP/1.1" 200') <= 1, text[-2000:]
    assert FINISHED not in text and 'POST /resume HTTP/1.1" 200' not in text, text[-2000:]
    pids = {int(p) for p in re.findall(r"pid=(\d+)\)", text)}
    assert len(pids) >= 3, pids  # API server, engine core and worker
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    assert [p for p in pids if alive(p)] == [], "a server process outlived its killed trainer"
