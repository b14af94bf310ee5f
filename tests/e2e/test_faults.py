"""Faults of a real (tiny) run: kill -9 of the trainer's main process before its first
checkpoint and during its first save, then the same command again.

After each kill no process of the run may remain 10 s later (megatron-core's spawn
Manager, the resource tracker, reward workers: megatron_dapo/lifetime.py), and the
finished run's metrics.jsonl holds each step once (megatron_dapo/output_dir.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from trainer_utils import REPO, read_rows, train_command, trainer_env, write_config

pytestmark = pytest.mark.e2e


def _run_processes(tag: str) -> list[int]:
    """Live processes whose environment carries the run's tag (children inherit it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"FAULT_TEST_TAG={tag}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(") ", 1)[1][0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def _kill_main_when(command: list[str], env: dict[str, str], log: Path, ready: Callable[[], bool],
                    timeout_s: float = 600) -> None:
    """Start the run, SIGKILL its main process (only it, as the OOM killer does) once `ready()`."""
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before the kill point:\n" + \
                log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        tag = env["FAULT_TEST_TAG"]
        deadline = time.monotonic() + 10
        while _run_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _run_processes(tag)
        assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left]
    finally:
        # A failing test must not leave its run behind: its own session holds only it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_kill_9_before_and_during_the_first_save_then_rerun(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # The first checkpoint is step 2's (save_interval=0: only at the end).
    config = write_config(tmp_path / "tiny.yaml", trainer={**_TRAINER, "save_interval": 0})
    command = train_command(config, f"trainer.output_dir={out}")
    env = {**trainer_env(tmp_path / "cache"), "FAULT_TEST_TAG": uuid.uuid4().hex}
    metrics = out / "metrics.jsonl"

    def logged_step_1() -> bool:
        return metrics.is_file() and '"step": 1,' in metrics.read_text()

    _kill_main_when(command, env, tmp_path / "a.log", logged_step_1)
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("step_*"))
    # Before: the rerun appended to the crashed attempt's lines (0, 1, 0, 1, 2).
    _kill_main_when(command, env, tmp_path / "b.log", lambda: (out / "checkpoints" / ".tmp-step_2").exists())
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_2"]
    # The embedded task's tokenizer travels with the checkpoint, so an export can be trained from.
    from megatron_dapo.data.tokenizer import SentencePieceTokenizer, load_tokenizer

    assert isinstance(load_tokenizer(out / "checkpoints" / "step_2" / "hf"), SentencePieceTokenizer)
    assert _run_processes(env["FAULT_TEST_TAG"]) == []


_TRAINER = {"total_training_steps": 2, "ppo_mini_batch_size": 2, "test_freq": 2, "device": "cpu",
            "max_tokens_per_microbatch": 256, "logprob_chunk_size": 64}
