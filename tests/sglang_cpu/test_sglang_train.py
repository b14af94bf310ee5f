"""The trainer with rollout.engine=sglang on SGLang's own CPU server: the colocated path the GPUs take.

TP=2 under torchrun (two ranks, so two servers at once, each fed by its own rank from the
actor's export). Short runs from the scratch model, without
the warm start and dynamic sampling, keep the tier within CI's budget: what they hold is the
hand-over of every step (generate, abort, idle, release, train, resume, sync with a version)
and the engine/actor gap at the float32 level at every step. That the run learns is measured
on the full example in docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tiers import requires, sglang_missing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from trainer_utils import (
    REPO,
    kill_engine_when,
    read_rows,
    step_logged,
    train_command,
    trainer_env,
)

pytestmark = [
    pytest.mark.sglang_cpu,
    pytest.mark.e2e,
    *requires(sglang_missing()),
]

# Half the tiny run's batch (4 prompts x 8): the restart's claims need responses in flight on each
# server, not a full batch (2026-11-28: the run took 4-5 minutes of CI at 8 prompts).
SHORT = ("rollout.engine=sglang", "model.sft_warm_start.enable=false", "algorithm.filter_groups.enable=false",
         "trainer.save_interval=100", "data.train_batch_size=4", "data.gen_batch_size=4",
         "trainer.ppo_mini_batch_size=4")


def kill_while_step_2_generates(command: list[str], tmp_path: Path, out: Path, server: str, *, rank: int | None = None,
                                timeout_s: float = 900) -> tuple[int, int]:
    """Run `command` and SIGKILL its SGLang server `server` once it generates after step 1 is logged.

    Returns the trainer's exit code and the last step logged at the kill: 1, or 2 when step 2's
    generation was over before the poll saw step 1 logged (a step generates in under a second).
    The trainer's log is tmp_path/trainer.log, its cache tmp_path/cache.
    """
    engine_log = out / "engine_logs" / f"{server}.log"
    after_step_1 = step_logged(out, 1)
    prefills: list[int] = []
    logged_at_kill: list[int] = []

    def generating_after_step_1() -> bool:
        if not prefills:
            if not after_step_1():
                return False
            prefills.append(engine_log.read_text(errors="replace").count("Prefill batch"))
        if engine_log.read_text(errors="replace").count("Prefill batch") <= prefills[0]:
            return False
        logged_at_kill.append(max(r["step"] for r in read_rows(out) if "rollout/train_logprob_abs_diff" in r))
        return True

    code = kill_engine_when(command, trainer_env(tmp_path / "cache"), tmp_path / "trainer.log",
                            generating_after_step_1, marker="sglang.launch_server", rank=rank, timeout_s=timeout_s)
    assert len(logged_at_kill) == 1, f"the server was killed {len(logged_at_kill)} times"
    return code, logged_at_kill[0]


# One run holds the trainer through SGLang's own servers on CPU: TP=2 under torchrun, two servers
# at once, a kill of one mid-generation. The one-process layout runs in test_sglang_routes.py
# (with R3) and the restart of a controller's own server in test_sglang_fleet.py; PP=2's
# export is the local engine's (tests/multirank), the servers receive the same buckets. A TP=1
# kill run and a PP=2 run here cost CI 6 minutes and held nothing these do not.
def test_a_server_another_rank_owns_is_restarted_by_its_owner_mid_generation(tmp_path):
    """TP=2 under torchrun: rank 1 owns sglang1, the controller (rank 0) generates on it. kill -9
    of sglang1's process group while a step after the first generates (its log shows a new
    prefill) is one restart: the controller asks rank 1 through the job's store, rank 1
    relaunches the server and loads its host copy of the last sync with the version, the lost
    requests are sent again (the engine checks every answer's version), and the run ends
    normally. The kill lands in step 2's generation, or in step 3's when step 2's was over
    before the poll saw step 1 logged (seen once on a loaded CI machine): the restart is counted
    from the step it interrupted. The actor is a LoRA one with the merged sync: SGLang serves the
    merged weights at the float32 gap (the full-parameter colocated path runs in test_sglang_routes.py)."""
    out = tmp_path / "run"
    # A LoRA actor (issue 62): each rank's server takes W + (alpha/r) B A merged from its own TP shard
    # (lora/state.py); the sync and the gap hold as a full model's (the same export, other tensors).
    command = train_command(REPO / "examples" / "tiny_cpu.yaml", *SHORT, "parallel.tensor_model_parallel_size=2",
                            "model.lora.rank=4", "model.lora.alpha=8", "optim.lr=2e-3",
                            # test_freq 0: 100 still evaluated before step 1 and after step 3 (unchecked).
                            f"trainer.output_dir={out}", "trainer.total_training_steps=3", "trainer.test_freq=0",
                            nproc=2)
    log = tmp_path / "trainer.log"
    code, killed_after = kill_while_step_2_generates(command, tmp_path, out, "sglang1", rank=1)
    assert code == 0, log.read_text()[-4000:]
    rows = [r for r in read_rows(out) if "rollout/train_logprob_abs_diff" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]  # no step repeated, none lost
    assert [r["train/num_responses"] for r in rows] == [32, 32, 32]
    assert killed_after in (1, 2), killed_after  # a later step's generation was interrupted
    assert [r["rollout/engine_restarts"] for r in rows] == [int(r["step"] > killed_after) for r in rows]
    assert max(r["rollout/train_logprob_abs_diff"] for r in rows) < 1e-5, rows
    text = log.read_text()
    assert "restarting its server in place for the controller" in text, text[-3000:]
    assert (out / "engine_logs" / "sglang1.log").read_text(errors="replace").count("server_args=ServerArgs(") == 2
