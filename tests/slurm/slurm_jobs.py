"""What the SLURM job tests share: submitting a script, waiting on its job, the trainer's fast settings.

``trainer_env`` (the fixture, in conftest.py) gives trainer jobs their environment.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from slurm_testbed import REPO, SlurmCluster

PROBE_DIR = Path(__file__).resolve().parent

TRAINER_MODULES = ("megatron_dapo.train", "megatron_dapo.trainer", "megatron_dapo.run")


@functools.cache
def trainer_missing() -> str | None:
    """Why the trainer cannot run yet, or None. train.py imports the loop lazily, so check those too."""
    if importlib.util.find_spec("megatron_dapo.train") is None:
        return "the trainer is not importable yet: megatron_dapo/train.py does not exist"
    code = "import " + ", ".join(TRAINER_MODULES)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True, capture_output=True, timeout=300)
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return f"the trainer is not importable yet (`python -c '{code}'`: {last})"


def submit(cluster: SlurmCluster, script: str, log: Path, *args: str, env: dict[str, str] | None = None,
          wait: bool = False, timeout: float = 240, options: tuple[str, ...] = ()) -> str:
    """sbatch `script` with `args` (the script's), `options` (sbatch's); returns the job id."""
    cmd = ["sbatch", "--parsable", f"--output={log}", *(["--wait"] if wait else []), *options, script, *args]
    proc = cluster.run(*cmd, env=env, check=False, timeout=timeout)
    job_id = proc.stdout.strip().split(";")[0]
    if wait:
        assert proc.returncode == 0, f"job {job_id} failed ({proc.returncode}): {proc.stderr}\n{read_log(log)}"
    else:
        assert proc.returncode == 0, proc.stderr
    return job_id


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log)"


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; job log:\n{read_log(log)}")


# A few seconds per step on two CPU ranks: a 2-layer random-init model, groups of 4, and a
# reward with spread in every group (slurm_rewards.py) so dynamic sampling fills each batch.
TINY_FAST = [
    "model.sft_warm_start.enable=false",
    "model.scratch.hidden_size=64",
    "model.scratch.num_layers=2",
    "model.scratch.intermediate_size=128",
    "model.scratch.max_position_embeddings=88",
    "data.max_prompt_length=80",
    "data.max_response_length=8",
    "data.train_batch_size=4",
    "data.gen_batch_size=8",
    "data.embedded.num_train=200",
    "data.embedded.num_val=8",
    "rollout.n=4",
    "reward.reward_fn=slurm_rewards:byte_parity",
    "reward.num_workers=0",
    "reward.overlong_buffer.len=4",
    "optim.lr=1e-3",
    "optim.lr_warmup_steps=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "trainer.ppo_mini_batch_size=2",
    "trainer.max_tokens_per_microbatch=256",
    "trainer.logprob_chunk_size=64",
]


def job_steps(out_dir: Path) -> list[int]:
    """Steps in metrics.jsonl; a line still being written (no newline yet) is not counted."""
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    complete = path.read_text().split("\n")[:-1]
    return [json.loads(line)["step"] for line in complete if line.strip()]
