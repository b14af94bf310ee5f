"""kill -9 of the real trainer in the middle of a run, then `trainer.resume=auto`: the metrics
of every step equal those of an uninterrupted run, and no step is lost or repeated.

Uses the e2e tier's tiny CPU configuration (tests/e2e/trainer_utils.py): 3 RL steps with a
checkpoint after each. The trainer is SIGKILLed as soon as the save of step 2 has begun
(its .tmp-step_2 directory exists) or, if that save is too quick to catch, right after it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from trainer_utils import read_rows, run_trainer, train_command, trainer_env, write_config

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

STEPS = 3
# Wall-clock measurements differ between any two runs; everything else must not.
TIMING_PREFIXES = ("timing_s/", "perf/")


def _deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES) and not k.endswith("_per_s")}


# A LoRA run (issue 62): its checkpoints hold adapters and their optimizer state only, and the
# KL loss's reference is its own base with adapters off; the same resume must hold.
LORA = ("model.lora.rank=4", "model.lora.alpha=8", "algorithm.use_kl_loss=true")


@pytest.mark.parametrize("actor", ["full", "lora"])
def test_kill_9_mid_run_then_resume_matches_uninterrupted_run(tmp_path: Path, actor: str) -> None:
    cache = tmp_path / "cache"
    overrides = (
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        *(LORA if actor == "lora" else ()),
    )

    straight_dir = tmp_path / "straight"
    config = write_config(tmp_path / "tiny.yaml")
    proc = run_trainer(config, f"trainer.output_dir={straight_dir}", *overrides, cache_dir=cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    straight = read_rows(straight_dir)

    killed_dir = tmp_path / "killed"
    ckpts = killed_dir / "checkpoints"
    with open(tmp_path / "killed.log", "w") as log:
        child = subprocess.Popen(
            train_command(config, f"trainer.output_dir={killed_dir}", *overrides),
            env=trainer_env(cache),
            cwd=Path(__file__).resolve().parents[2],
            stdout=log,
            stderr=log,
            start_new_session=True,  # the kill reaches its Manager and reward workers too
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and child.poll() is None:
            if (ckpts / ".tmp-step_2").exists() or (ckpts / "step_2").exists():
                break
            time.sleep(0.005)
        assert child.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    saved = int((ckpts / "latest").read_text().strip().removeprefix("step_"))
    assert saved in (1, 2)
    assert not (ckpts / f"step_{STEPS}").exists()

    proc = run_trainer(
        config, f"trainer.output_dir={killed_dir}", *overrides, "trainer.resume=auto", cache_dir=cache
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Equal metrics alone would also come from a fresh start: the run must say where it resumed.
    assert re.search(rf"resumed from \S*step_{saved} at step {saved}$", proc.stderr + proc.stdout, re.M)
    resumed = read_rows(killed_dir)

    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == list(range(1, STEPS + 1))
    assert [_deterministic(r) for r in resumed] == [_deterministic(r) for r in straight]
    assert (ckpts / "latest").read_text() == f"step_{STEPS}\n"
    if actor == "lora":
        _lora_checkpoint_holds_adapters_only_and_refuses_another_base(config, killed_dir, overrides, cache)


def _lora_checkpoint_holds_adapters_only_and_refuses_another_base(config: Path, out: Path, overrides: tuple[str, ...],
                                                                   cache: Path) -> None:
    import json

    from torch.distributed.checkpoint import FileSystemReader

    step = out / "checkpoints" / f"step_{STEPS}"
    keys = set(FileSystemReader(str(step / "dist")).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("decoder.") or k.startswith("embedding.") or k.startswith("output")}
    assert model_keys and all(k.endswith((".lora_A", ".lora_B")) for k in model_keys), sorted(model_keys)[:6]
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["lora"]["rank"] == 4 and len(manifest["lora"]["base"]["fingerprint"]) == 64
    # Another seed initialises another scratch base: its adapters do not belong to it.
    proc = run_trainer(config, f"trainer.output_dir={out}", *overrides, f"trainer.total_training_steps={STEPS + 1}",
                       "trainer.seed=7", "trainer.resume=auto", cache_dir=cache)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "holds LoRA adapters of the base" in last and "has other weights" in last, last
    assert (out / "checkpoints" / "latest").read_text() == f"step_{STEPS}\n"  # nothing lost
