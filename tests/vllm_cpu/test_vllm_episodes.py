"""Multi-turn episodes on vLLM's own CPU server: token ids in and out across turns (issue 40)."""

from __future__ import annotations

import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from model_utils import TINY_SHAPE, make_tiny_checkpoint

from megatron_dapo.rollout.controller import RolloutController

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from episode_utils import check_episode_exactness, check_streamed_episodes

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed (scripts/install_vllm_cpu.sh)"),
]


def test_episodes_on_vllm_are_token_exact(tmp_path):
    from megatron_dapo.rollout.vllm.engine import VLLMEngine

    checkpoint = make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=3, shape={"hidden_size": 128})
    engine = VLLMEngine.launch(checkpoint, name="vllm0", log_path=tmp_path / "vllm0.log", host="127.0.0.1",
                               device="cpu", vocab_size=TINY_SHAPE["vocab_size"], startup_timeout_s=900)
    try:
        out = check_episode_exactness(engine.generate, checkpoint, vocab_size=TINY_SHAPE["vocab_size"])
        # Streaming collection's driver on the same server: the abort cuts episodes mid-turn or
        # mid-call, the partial rollout resumes them (issue 40 item 3).
        streamed = check_streamed_episodes(RolloutController([engine]), checkpoint, vocab_size=TINY_SHAPE["vocab_size"])
    finally:
        engine.shutdown()
    assert out["policy_gap"] < 1e-4 and out["tool_tokens"] > 0 and out["turns_max"] >= 2, out
    assert streamed["policy_gap"] < 1e-4 and streamed["cut"] > 0, streamed
