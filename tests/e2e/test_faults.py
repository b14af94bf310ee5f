"""Faults of a real (tiny) run: kill -9 of the trainer's main process before its first
checkpoint and during its first save, then the same command again.

After each kill no process of the run may remain 10 s later (megatron-core's spawn
Manager, the resource tracker, reward workers: megatron_dapo/lifetime.py), and the
finished run's metrics.jsonl holds each step once (megatron_dapo/output_dir.py).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from trainer_utils import (
    REPO,
    kill_main_when,
    read_rows,
    run_processes,
    train_command,
    trainer_env,
    write_config,
)

from megatron_dapo.train import EXIT_PREEMPTED

pytestmark = pytest.mark.e2e


def test_kill_9_before_and_during_the_first_save_then_rerun(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # The first checkpoint is step 2's (save_interval=0: only at the end).
    config = write_config(tmp_path / "tiny.yaml", trainer={**_TRAINER, "save_interval": 0})
    command = train_command(config, f"trainer.output_dir={out}")
    env = {**trainer_env(tmp_path / "cache"), "FAULT_TEST_TAG": uuid.uuid4().hex}
    metrics = out / "metrics.jsonl"

    def logged_step_1() -> bool:
        return metrics.is_file() and '"step": 1,' in metrics.read_text()

    kill_main_when(command, env, tmp_path / "a.log", logged_step_1)
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("step_*"))
    # Before: the rerun appended to the crashed attempt's lines (0, 1, 0, 1, 2).
    kill_main_when(command, env, tmp_path / "b.log", lambda: (out / "checkpoints" / ".tmp-step_2").exists())
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_2"]
    # The embedded task's tokenizer travels with the checkpoint, so an export can be trained from.
    from megatron_dapo.data.tokenizer import SentencePieceTokenizer, load_tokenizer

    assert isinstance(load_tokenizer(out / "checkpoints" / "step_2" / "hf"), SentencePieceTokenizer)
    assert run_processes(env["FAULT_TEST_TAG"]) == []


_TRAINER = {"total_training_steps": 2, "ppo_mini_batch_size": 2, "test_freq": 2, "device": "cpu",
            "max_tokens_per_microbatch": 256, "logprob_chunk_size": 64}


def test_sigterm_saves_after_the_step_exits_75_and_the_rerun_continues(tmp_path: Path) -> None:
    """SIGTERM (preemption; SIGUSR1 and Ctrl-C take the same handler) saves after the step and exits
    EXIT_PREEMPTED with one line: before issue 42 it exited 0, which a requeue script cannot tell
    from a finished run."""
    out = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml", trainer={**_TRAINER, "save_interval": 0})
    command = train_command(config, f"trainer.output_dir={out}")
    env = {**trainer_env(tmp_path / "cache"), "FAULT_TEST_TAG": uuid.uuid4().hex}
    log = tmp_path / "a.log"
    with log.open("w") as f:
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        # Step 0 (validation) is logged: the loop, and with it the Ctrl-C handler, is running.
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Before: a KeyboardInterrupt traceback (Ctrl-C), and no checkpoint of the finished step.
    assert rc == EXIT_PREEMPTED, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()
    assert "stopped at step 1 of 2 on a signal (preemption or time limit); its checkpoint is saved: rerun the " \
        "same command to resume" in log.read_text()
    assert (out / "PREEMPTED").read_text() == "1\n"
    assert (out / "checkpoints" / "step_1" / "manifest.json").is_file()
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2]


def test_a_user_error_under_torchrun_prints_once_and_every_rank_exits_2(tmp_path: Path) -> None:
    config = write_config(tmp_path / "tiny.yaml")
    proc = subprocess.run(train_command(config, "model.hf_checkpoint=/nonexistent/model",
                                        f"trainer.output_dir={tmp_path / 'run'}", nproc=2),
                          env=trainer_env(tmp_path / "cache"), cwd=REPO, capture_output=True, text=True, timeout=600)
    line = ("error: model.hf_checkpoint='/nonexistent/model' is not a directory; point it at an HF model "
            "directory (config.json, *.safetensors, tokenizer files)")
    assert proc.stderr.count(line) == 1, proc.stderr[-4000:]
    # torchrun itself exits 1 whatever its workers' codes; its summary shows each rank's code.
    assert proc.returncode == 1
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-4000:]


@pytest.mark.parametrize(("overrides", "line"), [
    (("reward.reward_fn=no_such_mod_31:f",),
     "error: reward function 'no_such_mod_31:f': module 'no_such_mod_31' not found"),
    (("data.embedded.num_train=2",),
     "error: data.embedded.num_train holds 2 usable prompt(s), fewer than data.train_batch_size=4"),
], ids=["reward-module-missing", "too-few-prompts"])
def test_a_controller_side_user_error_exits_2_on_every_rank_before_any_work(tmp_path: Path, overrides, line) -> None:
    # Found by the preflight on rank 0; every rank raises it. torchrun SIGTERMs the other rank as soon
    # as the first exits: it used to die with -15 instead of exiting 2.
    config = write_config(tmp_path / "tiny.yaml", model={"sft_warm_start": {"enable": True, "num_steps": 20}})
    proc = subprocess.run(train_command(config, f"trainer.output_dir={tmp_path / 'run'}", *overrides, nproc=2),
                          env=trainer_env(tmp_path / "cache"), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.stderr.count(line) == 1, proc.stderr[-4000:]
    assert proc.stderr.count("exitcode  : 2") == 2, proc.stderr[-4000:]
    assert "exitcode  : -15" not in proc.stderr
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
    assert list((tmp_path / "cache").glob("sft-*")) == []  # stopped before the warm start


def test_controller_failing_in_rollout_ends_every_rank_in_bounded_time(tmp_path: Path) -> None:
    # Rank 0 stops in step 1's rollout (the reward circuit breaker) while rank 1 already waits
    # for its share of the batch; torchrun must end rank 1 and the error must name the cause.
    config = write_config(tmp_path / "tiny.yaml", reward={**_REWARD, "reward_fn": "e2e_reward_fns:always_fails"},
                          trainer={**_TRAINER, "val_before_train": False})
    start = time.monotonic()
    proc = subprocess.run(train_command(config, f"trainer.output_dir={tmp_path / 'run'}", nproc=2),
                          env=trainer_env(tmp_path / "cache"), cwd=REPO, capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-4000:]  # torchrun's own code
    assert proc.stderr.count("error: reward function 'e2e_reward_fns:always_fails' failed on") == 1, \
        proc.stderr[-4000:]
    assert "ZeroDivisionError: the grader divided by zero" in proc.stderr
    # Rank 1 lost its peer in a collective: one line, no traceback, after rank 0's exit code 2.
    assert "rank 1: stopped: another rank exited during a collective (" in proc.stderr
    assert "[rank1]: Traceback" not in proc.stderr
    assert "exitcode  : 2" in proc.stderr.split("Root Cause")[1], proc.stderr[-3000:]
    assert elapsed < 400, elapsed  # setup dominates; the default collective timeout is 10 minutes


_REWARD = {"num_workers": 1, "overlong_buffer": {"enable": True, "len": 4}}


def test_a_second_trainer_in_the_same_output_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml")
    command = train_command(config, f"trainer.output_dir={out}", "trainer.total_training_steps=4")
    env = trainer_env(tmp_path / "cache")
    with (tmp_path / "first.log").open("w") as log:
        first = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (out / ".run.lock").is_file():
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.02)
        second = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, second.stderr[-3000:]
    lines = [x for x in second.stderr.splitlines() if x.startswith("error:")]
    assert lines == [f"error: trainer.output_dir='{out}' is in use by another trainer (pid {first.pid} on host "
                     f"{socket.gethostname()}, since " + lines[0].split(", since ")[1]], second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    # The first run was not disturbed: every step once, its checkpoints intact, the lock gone.
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2, 3, 4]
    assert (out / "checkpoints" / "step_4" / "manifest.json").is_file()
    assert not (out / ".run.lock").exists()
