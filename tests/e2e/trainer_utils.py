"""Launching the trainer in subprocesses for the end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

TESTS_E2E = Path(__file__).resolve().parent
REPO = TESTS_E2E.parents[1]

# A few-second DAPO configuration: a 2-layer scratch model, groups of 4, 2 steps.
TINY_CONFIG = {
    "model": {
        "scratch": {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "intermediate_size": 128, "max_position_embeddings": 88},
        "sft_warm_start": {"enable": False},
    },
    "rollout": {"engine": "local", "n": 4, "val_kwargs": {"n": 2}},
    "data": {"max_prompt_length": 80, "max_response_length": 8, "train_batch_size": 4, "gen_batch_size": 8,
             "embedded": {"num_train": 200, "num_val": 8, "num_sft": 50}},
    "algorithm": {"filter_groups": {"enable": True, "max_num_gen_batches": 6}},
    "reward": {"reward_fn": "e2e_reward_fns:char_parity", "num_workers": 1,
               "overlong_buffer": {"enable": True, "len": 4}},
    "optim": {"lr": 1.0e-3, "lr_warmup_steps": 1},
    "trainer": {"total_training_steps": 2, "ppo_mini_batch_size": 2, "test_freq": 2, "save_interval": 1,
                "device": "cpu", "max_tokens_per_microbatch": 256, "logprob_chunk_size": 64},
}


def write_config(path: Path, **sections: dict) -> Path:
    """The tiny config with per-section overrides merged in, written as YAML."""
    config = json.loads(json.dumps(TINY_CONFIG))
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(config))
    return path


def trainer_env(cache_dir: Path) -> dict[str, str]:
    return {**os.environ, "MEGATRON_DAPO_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(TESTS_E2E), str(REPO), os.environ.get("PYTHONPATH", "")])}


def train_command(config: Path, *overrides: str, nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "megatron_dapo.train", str(config), *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "megatron_dapo.train", str(config), *overrides]


def run_trainer(config: Path, *overrides: str, cache_dir: Path, nproc: int = 1, timeout_s: float = 600,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the trainer to its end; `env` adds variables to trainer_env's."""
    return subprocess.run(train_command(config, *overrides, nproc=nproc), env={**trainer_env(cache_dir), **(env or {})},
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s)


def read_rows(output_dir: Path) -> list[dict]:
    with (output_dir / "metrics.jsonl").open() as f:
        return [json.loads(line) for line in f]


def run_processes(tag: str) -> list[int]:
    """Live processes whose environment holds FAULT_TEST_TAG=tag (a run's children inherit it)."""
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


def assert_run_gone(tag: str, within_s: float) -> None:
    """Every process of the run tagged `tag` has exited within `within_s` (their command lines if not)."""
    deadline = time.monotonic() + within_s
    while run_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = run_processes(tag)
    assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left]


def rank_pid(tag: str, rank: int) -> int | None:
    """The pid of the job's global rank `rank` (the launcher's worker, not its helpers), if it runs."""
    for pid in run_processes(tag):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"megatron_dapo.train" in cmdline and b"torch.distributed.run" not in cmdline:
            return pid
    return None


def start_and_wait(command: list[str], env: dict[str, str], log: Path, ready: Callable[[], bool],
                   timeout_s: float = 600) -> subprocess.Popen:
    """Start the run in a session of its own (output to `log`) and return it once `ready()`.

    The run ending first, or `timeout_s` passing, fails the test with the log's tail.
    """
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while not ready():
            assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before the kill point:\n" + \
                log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc


def kill_main_when(command: list[str], env: dict[str, str], log: Path, ready: Callable[[], bool],
                    timeout_s: float = 600) -> None:
    """Start the run, SIGKILL its main process (only it, as the OOM killer does) once `ready()`."""
    proc = start_and_wait(command, env, log, ready, timeout_s)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert_run_gone(env["FAULT_TEST_TAG"], within_s=10)
    finally:
        # A failing test must not leave its run behind: its own session holds only it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def step_logged(output_dir: Path, step: int) -> Callable[[], bool]:
    """Whether the run has logged its RL step `step` (a training row of metrics.jsonl)."""
    def ready() -> bool:
        path = output_dir / "metrics.jsonl"
        if not path.exists():
            return False
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return any(r.get("step") == step and "timing_s/gen" in r for r in rows)
    return ready


def engine_server(root_pid: int, marker: str, rank: int | None = None):
    """The engine server (its command line holds `marker`) that the run `root_pid` started, on
    global rank `rank` (its parent's RANK) when given; None if there is none (yet)."""
    import psutil

    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            if marker not in " ".join(proc.cmdline()):
                continue
            if rank is None or proc.parent().environ().get("RANK") == str(rank):
                return proc
        except psutil.Error:
            continue
    return None


def kill_engine_when(command: list[str], env: dict[str, str], log: Path, ready: Callable[[], bool], *,
                     marker: str, rank: int | None = None, timeout_s: float = 900) -> int:
    """Start the run; once `ready()`, SIGKILL the process group of its engine server (`marker`,
    engine_server); return the run's exit code. The server's group: its scheduler and workers too."""
    proc = start_and_wait(command, env, log, ready, timeout_s)
    try:
        server = engine_server(proc.pid, marker, rank)
        assert server is not None, f"no server {marker!r} of rank {rank} under the run"
        os.killpg(server.pid, signal.SIGKILL)  # ServerProcess starts each server in a session of its own
        return proc.wait(timeout=timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
