"""Multi-turn episodes on the local engine: policy log-probs are transformers', tool tokens masked (issue 40)."""

from __future__ import annotations

from episode_utils import check_episode_exactness
from model_utils import TINY_SHAPE, make_tiny_checkpoint

from megatron_dapo.rollout.local.engine import LocalEngine


def test_episodes_on_the_local_engine_are_token_exact(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=3)
    engine = LocalEngine(checkpoint, name="local0")
    out = check_episode_exactness(engine.generate, checkpoint, vocab_size=TINY_SHAPE["vocab_size"])
    assert out["policy_gap"] < 1e-4 and out["tool_tokens"] > 0 and out["turns_max"] >= 2, out


def test_streamed_episodes_stop_at_the_abort_and_resume_token_exact_on_the_local_engine(tmp_path):
    """Streaming collection's driver (issue 40 item 3): an abort mid-turn and mid-call, then the
    partial rollout resumed (a pending call runs again), every policy token still transformers'."""
    from episode_utils import check_streamed_episodes

    from megatron_dapo.rollout.controller import RolloutController

    checkpoint = make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=3)
    rollout = RolloutController([LocalEngine(checkpoint, name="local0")])
    try:
        out = check_streamed_episodes(rollout, checkpoint, vocab_size=TINY_SHAPE["vocab_size"])
    finally:
        rollout.shutdown()
    assert out["policy_gap"] < 1e-4 and out["cut"] > 0, out


def test_streamed_episodes_on_the_engine_process_of_the_asynchronous_loop(tmp_path):
    """The asynchronous loop's engine (disaggregated: the local engine in a process of its own) under
    the same driver: one request at a time through its pipe, cut by the abort, resumed, exact."""
    from episode_utils import check_streamed_episodes

    from megatron_dapo.rollout.controller import RolloutController
    from megatron_dapo.rollout.local.process import ProcessEngine

    checkpoint = make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=3)
    rollout = RolloutController([ProcessEngine(checkpoint, name="proc0", num_threads=1)])
    try:
        out = check_streamed_episodes(rollout, checkpoint, vocab_size=TINY_SHAPE["vocab_size"])
    finally:
        rollout.shutdown()
    assert out["policy_gap"] < 1e-4 and out["cut"] > 0, out
