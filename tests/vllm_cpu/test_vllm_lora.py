"""rollout.lora_sync=adapter on vLLM's own CPU server (issue 62): each step only the adapters
reach the engine, as a PEFT directory it serves on its base (lora/sync.py, rollout/vllm/engine.py).

A short LoRA run of the tiny example (the vLLM tier's settings, test_vllm_train.py) whose server
is SIGKILLed while step 2 generates: the gap between the engine's log-probs and the actor's stays
at the float32 level at every step, so the served policy is the base plus this step's adapter
(without naming the adapter in the requests it is 0.02-0.06 from step 2 on, measured 2026-12-02),
the restarted server (base only at its start) is given the last adapter again, and each sync
moves the adapters alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tiers import requires, vllm_missing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_vllm_train import SHORT, kill_while_step_2_generates
from trainer_utils import REPO, read_rows, train_command

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, *requires(vllm_missing())]

LORA = ("model.lora.rank=8", "model.lora.alpha=16", "optim.lr=2e-3", "rollout.lora_sync=adapter")


def test_adapter_only_sync_serves_the_actors_policy_through_a_restart(tmp_path):
    out = tmp_path / "run"
    command = train_command(REPO / "examples" / "tiny_cpu.yaml", *SHORT, *LORA, f"trainer.output_dir={out}",
                            "trainer.total_training_steps=3")
    log = tmp_path / "trainer.log"
    engine_log = out / "engine_logs" / "vllm0.log"
    code, killed_after = kill_while_step_2_generates(command, tmp_path, out)
    assert code == 0, log.read_text()[-4000:]
    rows = [r for r in read_rows(out) if "rollout/train_logprob_abs_diff" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert killed_after in (1, 2), killed_after
    assert [r["rollout/engine_restarts"] for r in rows] == [int(r["step"] > killed_after) for r in rows]
    assert max(r["rollout/train_logprob_abs_diff"] for r in rows) < 1e-4, rows
    # The adapters alone: rank 8 on every linear of the 4-layer 128-wide model is 8.7% of its
    # parameters (3.3 MB in float32); each sync wrote and loaded one PEFT directory.
    assert all(0 < r["sync/num_bytes"] < 0.15 * 3_318_272 for r in rows), [r["sync/num_bytes"] for r in rows]
    assert sorted(p.name for p in (out / "lora_adapters").iterdir()) == ["v3"]
    text = engine_log.read_text(errors="replace")
    loads = text.count('POST /v1/load_lora_adapter HTTP/1.1" 200')
    assert loads == 5, loads  # v0..v3, and v1 again into the restarted server
