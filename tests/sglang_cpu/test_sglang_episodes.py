"""Multi-turn episodes on SGLang's own CPU server: token ids in and out across turns (issue 40)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from model_utils import TINY_SHAPE, make_tiny_checkpoint

from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import SGLangServerConfig, sglang_python

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from episode_utils import check_episode_exactness, check_streamed_episodes

pytestmark = [
    pytest.mark.sglang_cpu,
    pytest.mark.skipif(sglang_python() is None, reason="SGLang is not installed (make install-sglang-cpu)"),
]


def test_episodes_on_sglang_are_token_exact(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=3, shape={"hidden_size": 128})
    config = SGLangServerConfig(model_path=str(checkpoint), device="cpu", dtype="float32", max_total_tokens=32768,
                                host="127.0.0.1", log_path=str(tmp_path / "sglang0.log"))
    engine = SGLangEngine.launch(config, name="sglang0", vocab_size=TINY_SHAPE["vocab_size"], startup_timeout_s=600)
    try:
        out = check_episode_exactness(engine.generate, checkpoint, vocab_size=TINY_SHAPE["vocab_size"])
        # Streaming collection's driver on the same server: the abort cuts episodes mid-turn or
        # mid-call, the partial rollout resumes them (issue 40 item 3).
        streamed = check_streamed_episodes(RolloutController([engine]), checkpoint, vocab_size=TINY_SHAPE["vocab_size"])
    finally:
        engine.shutdown()
    assert out["policy_gap"] < 1e-4 and out["tool_tokens"] > 0 and out["turns_max"] >= 2, out
    assert streamed["policy_gap"] < 1e-4 and streamed["cut"] > 0, streamed
