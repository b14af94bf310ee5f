"""One rank of a 2-rank torchrun job (DP=2, the tiny CPU run) raises in rollout, dispatch, update
or save (megatron_dapo/faults.py): every rank must exit within a bound, the job's error must
name the failing rank and its error, and no process of the job may remain.

The others are then waiting, or about to wait, in a collective with the failed rank: the
control plane's gloo groups (controller_wait_timeout_minutes, 6 h by default), the
gradient all-reduce, the checkpoint's collectives. A hang here costs a cluster hours.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from trainer_utils import REPO, rank_pid, run_processes, train_command, trainer_env, write_config

pytestmark = pytest.mark.e2e

# From the failing rank's fault to torchrun's exit: the peer's grace (train.PEER_GONE_GRACE_S, 5 s)
# plus slack for a loaded machine; far below any collective timeout (10 min and 6 h).
EXIT_BOUND_S = 60.0
FAULT_LOGGED = "injected fault at the start of"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Shared by the cases: the embedded task and the scratch model are built once.
    return tmp_path_factory.mktemp("cache")


# Rank 1 failing in rollout or dispatch (its peer then waits in the controller's broadcast or the
# scatter) meets the same peer-gone detection as in update; those two cases cost CI 66 s.
@pytest.mark.parametrize("phase,rank", [("update", 1), ("save", 1), ("rollout", 0)])
def test_a_rank_failing_mid_step_ends_the_job_naming_it(tmp_path: Path, cache_dir: Path, phase: str,
                                                        rank: int) -> None:
    # One step, saved at its end: every phase is reached once.
    config = write_config(tmp_path / "tiny.yaml",
                          trainer={"total_training_steps": 1, "ppo_mini_batch_size": 2, "test_freq": 0,
                                   "val_before_train": False, "save_interval": 1, "device": "cpu",
                                   "max_tokens_per_microbatch": 256, "logprob_chunk_size": 64})
    tag = uuid.uuid4().hex
    env = {**trainer_env(cache_dir), "MEGATRON_DAPO_FAULT": f"{phase}:{rank}", "FAULT_TEST_TAG": tag}
    log = tmp_path / "job.log"
    with log.open("w") as out:
        proc = subprocess.Popen(train_command(config, f"trainer.output_dir={tmp_path / 'run'}", nproc=2),
                                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # setup on a loaded 2-core machine
        while FAULT_LOGGED not in log.read_text():
            assert proc.poll() is None, f"the job ended (rc {proc.returncode}) before the fault:\n" + \
                log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        fault_at = time.monotonic()
        try:
            rc = proc.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still ran {EXIT_BOUND_S:.0f} s after rank {rank} failed in {phase}:\n"
                        + log.read_text()[-3000:])
        elapsed = time.monotonic() - fault_at
        text = log.read_text()
        assert rc == 1, text[-3000:]  # torchrun's own code when a worker failed
        # The failing rank's own error, once, then torchrun naming it as the root cause.
        error = f"megatron_dapo.faults.InjectedFault: rank {rank}: {FAULT_LOGGED} {phase}"
        assert text.split("megatron_dapo.train FAILED")[0].count(error) == 1, text[-4000:]
        root = text.split("Root Cause (first observed failure):")[1].split("=====")[0]
        assert f"rank      : {rank} (local_rank: {rank})" in root, text[-3000:]
        # ... with the error itself, not "error_file: <N/A>" (train.record_for_launcher).
        assert f"InjectedFault: rank {rank}: {FAULT_LOGGED} {phase}" in root, root
        # The other rank only lost its peer: one line, no traceback of its own.
        peer = 1 - rank
        assert f"rank {peer}: stopped: another rank exited during a collective (" in text, text[-4000:]
        assert f"[rank{peer}]: Traceback" not in text, text[-4000:]
        # Nothing of the job is left (ranks, megatron-core's checkpoint Manager, reward workers)
        # once the kernel has delivered the parent-death signals.
        gone_by = time.monotonic() + 10
        while run_processes(tag) and time.monotonic() < gone_by:
            time.sleep(0.2)
        left = run_processes(tag)
        assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left]
        if phase == "save":
            # The save never completed, so no checkpoint was published (a rerun deletes the
            # leftover .tmp-step_1 first: tests/unit/test_output_dir.py).
            assert not (tmp_path / "run" / "checkpoints" / "step_1").exists()
        print(f"{phase}:{rank}: every rank gone {elapsed:.1f} s after the fault")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_rank_killed_mid_run_is_named_by_the_others(tmp_path: Path, cache_dir: Path) -> None:
    """kill -9 of rank 1 (no error of its own, only torchrun's "Signal 9"): rank 0's one line names it."""
    config = write_config(tmp_path / "tiny.yaml",
                          trainer={"total_training_steps": 2, "ppo_mini_batch_size": 2, "test_freq": 0,
                                   "val_before_train": False, "save_interval": 0, "device": "cpu",
                                   "max_tokens_per_microbatch": 256, "logprob_chunk_size": 64})
    tag = uuid.uuid4().hex
    env = {**trainer_env(cache_dir), "FAULT_TEST_TAG": tag}
    log, metrics = tmp_path / "job.log", tmp_path / "run" / "metrics.jsonl"
    with log.open("w") as out:
        proc = subprocess.Popen(train_command(config, f"trainer.output_dir={tmp_path / 'run'}", nproc=2),
                                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().strip()):  # step 1 done: rank 1 is in step 2
            assert proc.poll() is None, f"the job ended (rc {proc.returncode}) before step 1 ended:\n" + \
                log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        victim = rank_pid(tag, 1)
        assert victim is not None, log.read_text()[-3000:]
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=EXIT_BOUND_S)
        text = log.read_text()
        assert "rank 0: stopped: another rank exited during a collective (" in text, text[-4000:]
        line = next(x for x in text.splitlines() if "rank 0: stopped:" in x)
        assert f"rank 1 (pid {victim} on " in line and "is gone" in line, line
        print(line)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
