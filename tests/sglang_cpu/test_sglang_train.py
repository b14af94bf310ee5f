"""The trainer with rollout.engine=sglang on SGLang's own CPU server: the colocated path the GPUs take.

One process (one server) and TP=2 / PP=2 under torchrun (two ranks, so two servers at once,
each fed by its own rank from the actor's export). Short runs from the scratch model, without
the warm start and dynamic sampling, keep the tier within CI's budget: what they hold is the
hand-over of every step (generate, abort, idle, release, train, resume, sync with a version)
and the engine/actor gap at the float32 level at every step. That the run learns is measured
on the full example in docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_dapo.rollout.sglang.server import sglang_python

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from trainer_utils import (
    REPO,
    kill_engine_when,
    read_rows,
    run_trainer,
    step_logged,
    train_command,
    trainer_env,
)

pytestmark = [
    pytest.mark.sglang_cpu,
    pytest.mark.e2e,
    pytest.mark.skipif(sglang_python() is None, reason="SGLang is not installed (make install-sglang-cpu)"),
]

SHORT = ("rollout.engine=sglang", "model.sft_warm_start.enable=false", "algorithm.filter_groups.enable=false",
         "trainer.save_interval=100", "data.train_batch_size=8", "data.gen_batch_size=8",
         "trainer.ppo_mini_batch_size=8")


# TP=1 trains in test_a_killed_server_costs_a_restart_not_the_run and TP=2 in
# test_a_server_another_rank_owns_is_restarted_by_its_owner_mid_generation, with the same
# checks per step: one run per layout keeps the tier's CI time down.
@pytest.mark.parametrize("layout", [("parallel.pipeline_model_parallel_size=2",)], ids=["pp2"])
def test_training_through_sglang_keeps_the_gap_at_float32_level(tmp_path, layout):
    out = tmp_path / "run"
    nproc = 2
    proc = run_trainer(REPO / "examples" / "tiny_cpu.yaml", *SHORT, *layout, f"trainer.output_dir={out}",
                       "trainer.total_training_steps=2", "trainer.test_freq=2", cache_dir=tmp_path / "cache",
                       nproc=nproc, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in read_rows(out) if "rollout/train_logprob_abs_diff" in r]
    assert len(rows) == 2
    # The server's float32 log-probs against the actor's, every step, after every weight sync.
    assert max(r["rollout/train_logprob_abs_diff"] for r in rows) < 1e-5, rows
    assert all(r["train/num_responses"] == 64 for r in rows)
    logs = sorted(p.name for p in (out / "engine_logs").iterdir())
    # One server per rank group: two ranks at rollout TP 1 are two servers at once.
    assert logs == ["sglang0.log", "sglang1.log"]
    assert "server_args=ServerArgs(" in (out / "engine_logs" / "sglang0.log").read_text()


def test_a_killed_server_costs_a_restart_not_the_run(tmp_path):
    """One-process colocated run on CPU: its server is fed by the controller, which keeps the
    weights, so kill -9 of the server after step 1 is one restart (same log, weights and version
    reloaded) and the run ends normally with every step's gap at the float32 level."""
    out = tmp_path / "run"
    command = train_command(REPO / "examples" / "tiny_cpu.yaml", *SHORT, f"trainer.output_dir={out}",
                            "trainer.total_training_steps=3", "trainer.test_freq=100")
    log = tmp_path / "trainer.log"
    code = kill_engine_when(command, trainer_env(tmp_path / "cache"), log, step_logged(out, 1),
                            marker="sglang.launch_server")
    assert code == 0, log.read_text()[-4000:]
    rows = [r for r in read_rows(out) if "rollout/train_logprob_abs_diff" in r]
    assert [r["train/num_responses"] for r in rows] == [64, 64, 64]
    assert rows[-1]["rollout/engine_restarts"] == 1
    assert max(r["rollout/train_logprob_abs_diff"] for r in rows) < 1e-5
    assert (out / "engine_logs" / "sglang0.log").read_text().count("server_args=ServerArgs(") == 2


def test_a_server_another_rank_owns_is_restarted_by_its_owner_mid_generation(tmp_path):
    """TP=2 under torchrun: rank 1 owns sglang1, the controller (rank 0) generates on it. kill -9
    of sglang1's process group while step 2 generates (its log shows a new prefill) is one
    restart: the controller asks rank 1 through the job's store, rank 1 relaunches the server
    and loads its host copy of the last sync with the version, the lost requests are sent again
    (the engine checks every answer's version), and the run ends normally."""
    out = tmp_path / "run"
    command = train_command(REPO / "examples" / "tiny_cpu.yaml", *SHORT, "parallel.tensor_model_parallel_size=2",
                            f"trainer.output_dir={out}", "trainer.total_training_steps=3", "trainer.test_freq=100",
                            nproc=2)
    log = tmp_path / "trainer.log"
    engine_log = out / "engine_logs" / "sglang1.log"
    after_step_1 = step_logged(out, 1)
    prefills: list[int] = []

    def generating_step_2() -> bool:
        if not prefills:
            if not after_step_1():
                return False
            prefills.append(engine_log.read_text(errors="replace").count("Prefill batch"))
        return engine_log.read_text(errors="replace").count("Prefill batch") > prefills[0]

    code = kill_engine_when(command, trainer_env(tmp_path / "cache"), log, generating_step_2,
                            marker="sglang.launch_server", rank=1)
    assert code == 0, log.read_text()[-4000:]
    rows = [r for r in read_rows(out) if "rollout/train_logprob_abs_diff" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]  # no step repeated, none lost
    assert [r["train/num_responses"] for r in rows] == [64, 64, 64]
    assert [r["rollout/engine_restarts"] for r in rows] == [0, 1, 1]
    assert max(r["rollout/train_logprob_abs_diff"] for r in rows) < 1e-5, rows
    text = log.read_text()
    assert "restarting its server in place for the controller" in text, text[-3000:]
    assert engine_log.read_text(errors="replace").count("server_args=ServerArgs(") == 2
