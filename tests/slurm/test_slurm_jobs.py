"""Our sbatch scripts on a real one-node SLURM cluster (fixture in conftest.py).

Without the trainer: two srun tasks validate the tiny config; slurm/dapo_tiny.sbatch starts
two ranks that rendezvous through megatron_dapo.parallel from the SLURM environment; and
the script's requeue logic reacts to a pre-timeout signal (a probe plays the trainer's side).
With the trainer (megatron_dapo.train importable): the tiny run completes, and a run sent
SIGUSR1 checkpoints, is requeued and resumes from that step with no step lost or repeated.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from slurm_jobs import PROBE_DIR, TINY_FAST, job_steps, read_log, submit, wait_for
from slurm_testbed import REPO, SlurmCluster

pytestmark = pytest.mark.slurm



def test_two_srun_tasks_validate_the_tiny_config(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    log = tmp_path / "validate.out"
    wrap = f"srun {sys.executable} -m megatron_dapo.cli config validate examples/tiny_cpu.yaml --world-size 2"
    submit(slurm_cluster, "--ntasks=2", log, "--wrap", wrap, wait=True)
    lines = read_log(log).splitlines()
    assert lines.count("examples/tiny_cpu.yaml: OK (data-parallel size 2 at world size 2)") == 2, lines


def _probe_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"ENTRY": "rendezvous_probe", "PYTHONPATH": f"{PROBE_DIR}:{REPO}", "PYTHON": sys.executable,
            "LOG_ROOT": str(tmp_path / "logs"), **extra}


def test_tiny_script_ranks_rendezvous_from_slurm_env(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    log = tmp_path / "tiny.out"
    out_dir = tmp_path / "run"
    job = submit(slurm_cluster, "slurm/dapo_tiny.sbatch", log, f"trainer.output_dir={out_dir}",
                  env=_probe_env(tmp_path), wait=True)
    text = read_log(log)
    port = 20000 + int(job) % 20000
    for rank in (0, 1):
        # srun --label prefixes each line with the task id.
        assert re.search(rf"^{rank}: probe rank {rank}/2 local {rank} master {slurm_cluster.node}:{port} dp 2 sum 3$",
                         text, re.M), text
    assert f"job {job} attempt 0: ranks exited with 0" in text
    # The per-job log directory holds the resolved config the ranks ran with.
    saved = (tmp_path / "logs" / f"dapo-tiny-{job}" / "config-attempt0.yaml").read_text()
    assert f"output_dir: {out_dir}" in saved and "device: cpu" in saved and "n_gpus_per_node: 2" in saved
    assert slurm_cluster.job_field(job, "Restarts") == "0"


def test_bad_override_fails_the_job_with_one_line(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    log = tmp_path / "bad.out"
    proc = slurm_cluster.run("sbatch", "--parsable", "--wait", f"--output={log}", "slurm/dapo_tiny.sbatch",
                             "algorithm.clip_ratio_hgh=0.3", env=_probe_env(tmp_path), check=False, timeout=240)
    assert proc.returncode == 2, read_log(log)
    errors = [line for line in read_log(log).splitlines() if line.startswith("error:")]
    assert errors == ["error: command line: algorithm.clip_ratio_hgh: unknown key; "
                      "did you mean 'algorithm.clip_ratio_high'?"], read_log(log)
    assert "probe rank" not in read_log(log)  # no rank was started


# Seconds between a requeue and the release of the requeued job (see the credential note below).
REQUEUE_RELEASE_S = 10


def test_pre_timeout_signal_requeues_the_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    log = tmp_path / "preempt.out"
    out_dir = tmp_path / "run"
    job = submit(slurm_cluster, "slurm/dapo_tiny.sbatch", log, f"trainer.output_dir={out_dir}",
                  env=_probe_env(tmp_path, PROBE_WAIT_SIGNAL="1"))
    wait_for(lambda: read_log(log).count("waiting for SIGUSR1") == 2, 120, "both ranks to wait", log)
    # What SLURM sends --signal=USR1@60 before the time limit; scancel delivers it to the ranks.
    slurm_cluster.run("scancel", "--signal=USR1", job)
    wait_for(lambda: slurm_cluster.job_field(job, "Restarts") == "1", 60, "the requeue", log)
    # A requeued job is held until its begin time; release it sooner, but not at once: slurmd
    # keeps the first attempt's credential revoked for a few seconds, and a launch inside that
    # window fails the job ("Job credential revoked").
    slurm_cluster.run("scontrol", "update", f"JobId={job}", f"StartTime=now+{REQUEUE_RELEASE_S}", check=False)
    assert slurm_cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 180) == "COMPLETED", read_log(log)
    text = read_log(log)
    assert f"job {job} attempt 0: ranks exited with 75" in text
    assert f"checkpointed at step 7 before the time limit; requeueing job {job}" in text
    assert text.count(f"job {job} attempt 1: ranks exited with 0") == 1
    # Both ranks got the signal itself (not a SIGTERM from a dying job) and ran again.
    for rank in (0, 1):
        assert f"{rank}: probe rank {rank} got signal SIGUSR1" in text
        assert f"{rank}: probe rank {rank} attempt 1" in text
    # Rank 0 wrote the marker in attempt 0; the script removed it before attempt 1.
    assert not (out_dir / "PREEMPTED").exists()
    assert slurm_cluster.job_field(job, "ExitCode") == "0:0"


# ------------------------------------------------------------------ with the trainer

def test_signal_saves_requeues_and_resumes(slurm_cluster: SlurmCluster, trainer_env: dict[str, str],
                                           tmp_path: Path) -> None:
    log = tmp_path / "resume.out"
    out_dir = tmp_path / "run"
    total = 10
    overrides = " ".join([*TINY_FAST, f"trainer.total_training_steps={total}", "trainer.save_interval=100",
                          f"trainer.output_dir={out_dir}"])
    job = submit(slurm_cluster, "slurm/dapo_tiny.sbatch", log,
                  env={**trainer_env, "OVERRIDES": overrides, "LOG_ROOT": str(tmp_path / "logs")})
    wait_for(lambda: len(job_steps(out_dir)) >= 1, 180, "the first step", log)
    slurm_cluster.run("scancel", "--signal=USR1", job)
    wait_for(lambda: slurm_cluster.job_field(job, "Restarts") == "1", 120, "the requeue", log)
    slurm_cluster.run("scontrol", "update", f"JobId={job}", f"StartTime=now+{REQUEUE_RELEASE_S}", check=False)
    assert slurm_cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 240) == "COMPLETED", read_log(log)
    text = read_log(log)
    match = re.search(rf"checkpointed at step (\d+) before the time limit; requeueing job {job}", text)
    assert match is not None, text
    saved = int(match.group(1))
    assert 1 <= saved < total
    # The second attempt loaded that checkpoint (not a fresh start, which would also end
    # with steps 1..total after the metrics file is truncated) ...
    assert (out_dir / "checkpoints" / f"step_{saved}").is_dir()
    assert re.search(rf"^0: .*resumed from \S*step_{saved} at step {saved}$", text, re.M), text
    # ... and every step was logged once, in order, none lost or repeated; the run completed
    # (its own test before 2026-11-28: the same script without the signal, 42 s of CI).
    assert job_steps(out_dir) == list(range(1, total + 1)), text
    assert text.count(f"job {job} attempt 1: ranks exited with 0") == 1
    assert not (out_dir / "PREEMPTED").exists()
