"""The actor's optimizer state exists, and a resumed checkpoint is loaded, before any engine starts.

A colocated SGLang server sizes its memory pool once, from the memory free when it starts
(sglang 0.5.23 `kv_pool_runtime.py`); Adam's moments are made lazily at the first step (torch,
Transformer Engine 2.11, apex). Started in the old order, the engines counted as free the 8
bytes per parameter and data-parallel shard that the first step then took, and a requeued run
loaded its checkpoint while they held their share (DESIGN.md "The optimizer state exists before
the engines start"). The real trainer runs (engine_start_spy.py records each event of the build
with the optimizer state's bytes then): a fresh run, then a resume of its checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from trainer_utils import TESTS_E2E, trainer_env, write_config


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _events(record) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def _train(record, config, *overrides, cache_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TESTS_E2E / "engine_start_spy.py"), str(record), str(config),
                           *overrides], env=trainer_env(cache_dir), cwd=TESTS_E2E.parents[1], capture_output=True,
                          text=True, timeout=600)


def test_optimizer_state_and_resumed_checkpoint_come_before_the_engines(tmp_path, cache_dir):
    config = write_config(tmp_path / "tiny.yaml")
    out = tmp_path / "run"
    common = (f"trainer.output_dir={out}", "trainer.test_freq=0", "trainer.val_before_train=false")
    fresh, resumed = tmp_path / "fresh.jsonl", tmp_path / "resumed.jsonl"
    proc = _train(fresh, config, "trainer.total_training_steps=1", *common, cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = _events(fresh)
    assert [e["event"] for e in events] == ["launch_rank_engines", "build_controller"]
    # fp32 AdamW on CPU: two fp32 moments per parameter (+ a step scalar each), all there already.
    state = events[0]["optimizer_state_bytes"]
    assert state > 0 and events[1]["optimizer_state_bytes"] == state
    proc = _train(resumed, config, "trainer.total_training_steps=2", *common, cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = _events(resumed)
    assert [e["event"] for e in events] == ["checkpoint_load", "launch_rank_engines", "build_controller"]
    assert events[0]["optimizer_state_bytes"] == state  # made before the load, which fills it in place
    assert events[1]["optimizer_state_bytes"] == state
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
