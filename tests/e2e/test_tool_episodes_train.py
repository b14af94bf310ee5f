"""The tool run through the whole trainer (issue 40): episodes in rounds, tool tokens out of the loss.

A short SFT teaches the call format (half of the 3-digit products are solved with
``<calc>a*b</calc><result>c</result>``), then two RL steps run episodes with the calculator.
Per step: calls happen and are answered; the actor's old log-probs equal the engine's on the
policy's tokens (a tool token in the mask would add its log-prob, 0.0 from the engine, against
the actor's: a gap of nats, not 1e-7); held-out evaluation runs episodes too.
"""

from __future__ import annotations

import pytest
from trainer_utils import REPO, read_rows, run_trainer

pytestmark = pytest.mark.e2e


def test_two_steps_of_the_tool_run_call_the_calculator_and_keep_tool_tokens_out_of_the_loss(tmp_path):
    out = tmp_path / "run"
    proc = run_trainer(REPO / "examples" / "tiny_tools_cpu.yaml", f"trainer.output_dir={out}",
                       "model.sft_warm_start.num_steps=100", "trainer.total_training_steps=2", "trainer.test_freq=2",
                       "trainer.save_interval=100", "data.embedded.num_train=2000", "data.embedded.num_sft=2000",
                       "data.embedded.num_val=32", cache_dir=tmp_path / "cache", timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["tools/call_rate"] > 0.05 and row["tools/turns_max"] == 2.0
        assert row["rollout/train_logprob_abs_diff"] < 1e-4
        assert 0.0 <= row["tools/error_rate"] <= 1.0
    assert rows[-1]["val/tools/call_rate"] > 0.05 and "val/acc" in rows[-1]
