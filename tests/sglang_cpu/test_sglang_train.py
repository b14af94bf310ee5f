"""The trainer with rollout.engine=sglang on SGLang's own CPU server: the colocated path the GPUs take.

One process (one server) and TP=2 / PP=2 under torchrun (two ranks, so two servers at once,
each fed by its own rank from the actor's export). Short runs from the scratch model, without
the warm start and dynamic sampling, keep the tier within CI's budget: what they hold is the
hand-over of every step (generate, abort, idle, release, train, resume, sync with a version)
and the engine/actor gap at the float32 level at every step. That the run learns is measured
on the full example in docs/benchmarks.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from megatron_dapo.rollout.sglang.server import sglang_python

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from trainer_utils import REPO, read_rows, run_trainer

pytestmark = [
    pytest.mark.sglang_cpu,
    pytest.mark.e2e,
    pytest.mark.skipif(sglang_python() is None, reason="SGLang is not installed (make install-sglang-cpu)"),
]

SHORT = ("rollout.engine=sglang", "model.sft_warm_start.enable=false", "algorithm.filter_groups.enable=false",
         "trainer.save_interval=100", "data.train_batch_size=8", "data.gen_batch_size=8",
         "trainer.ppo_mini_batch_size=8")


def _shm_sglang() -> set[str]:
    """SGLang's load snapshots (the server tier also holds its semaphores, on a quiet machine)."""
    return {p for p in os.listdir("/dev/shm") if p.startswith("sglang_")}


@pytest.mark.parametrize("layout", [(), ("parallel.tensor_model_parallel_size=2",),
                                    ("parallel.pipeline_model_parallel_size=2",)], ids=["tp1", "tp2", "pp2"])
def test_training_through_sglang_keeps_the_gap_at_float32_level(tmp_path, layout):
    out = tmp_path / "run"
    nproc = 1 if not layout else 2
    shm_before = _shm_sglang()
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
    assert logs == (["sglang0.log"] if nproc == 1 else ["sglang0.log", "sglang1.log"])
    assert "server_args=ServerArgs(" in (out / "engine_logs" / "sglang0.log").read_text()
    assert _shm_sglang() <= shm_before
