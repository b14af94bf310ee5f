"""Rollout routing replay (R3) from SGLang's own CPU server (sglang 0.5.18), issue 39.

SGLang returns the routed experts of a request (``return_routed_experts``) when the server runs
with ``--enable-return-routed-experts``: base64 int32 [prompt + output - 1, num_hidden_layers, k]
in ``meta_info["routed_experts"]``. Its capturer's host buffer is allocated with
``pin_memory=True`` (state_capturer/base.py, BaseHostCache), which CPU torch refuses; the venv's
start-up fix (scripts/sglang_cpu/site/_megatron_dapo_routes_host_cache.py) allocates it unpinned
there. Held here: the capturer's fix, and the trainer replays the routes step after step
(``moe/replay_route_mismatch`` 0), also under full activation recompute. That the server starts
with the flag and every finished row carries the experts transformers' own routers choose for
the same tokens is held on test_sglang_moe.py's server (one SGLang start less in CI).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tiers import requires, sglang_missing

from megatron_dapo.rollout.sglang.server import sglang_python

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from trainer_utils import read_rows, run_trainer, write_config

pytestmark = [
    pytest.mark.sglang_cpu,
    *requires(sglang_missing()),
]

PROMPTS = [[5, 17, 42, 8], [3, 9], [60, 61, 62, 63, 64, 65]]


def _sglang_source(relative: str) -> str:
    origin = subprocess.run([sglang_python(), "-c", "import importlib.util; print(importlib.util.find_spec('sglang').origin)"],
                            capture_output=True, text=True, check=True).stdout.strip()
    return (Path(origin).parent / "srt" / relative).read_text()


def test_the_capturer_pins_its_host_buffer_which_the_venv_allocates_unpinned_on_a_cpu():
    base = _sglang_source("state_capturer/base.py")
    host_cache = base[base.index("class BaseHostCache"):]
    assert "pin_memory=True" in host_cache.split("def ", 2)[1]  # its __init__: why the fix exists
    probe = ("import torch; from sglang.srt.state_capturer.base import BaseHostCache; "
             "c = BaseHostCache(8, 3, 2, name='routed_experts'); "
             "print(tuple(c.buffer.shape), c.buffer.dtype, c.buffer.is_pinned(), torch.cuda.is_available())")
    out = subprocess.run([sglang_python(), "-W", "ignore", "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "(8, 3, 2) torch.int32 False False"


MOE_SCRATCH = {"family": "qwen3_moe", "hidden_size": 128, "num_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 88,
               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.mark.e2e
def test_the_trainer_replays_sglangs_routes_at_every_step_under_full_recompute(tmp_path):
    """One-process colocated run: the forward of every update and its recompute both replay the
    server's routes (without recompute the same replay runs once; the local engine's runs in
    tests/e2e/test_routing_replay_train.py hold both settings)."""
    out = tmp_path / "run"
    config = write_config(tmp_path / "moe.yaml", model={"scratch": MOE_SCRATCH, "sft_warm_start": {"enable": False},
                                                        "recompute_activations": True})
    proc = run_trainer(config, f"trainer.output_dir={out}", "trainer.total_training_steps=2", "trainer.test_freq=0",
                       "trainer.val_before_train=false", "rollout.engine=sglang", "algorithm.routing_replay=rollout",
                       cache_dir=tmp_path / "cache", timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # Every token of every layer was forwarded (and recomputed) on SGLang's experts.
        assert row["moe/replay_route_mismatch"] == 0.0
        assert 0.0 <= row["moe/router_disagreement"] <= 1.0
        # The engine's weights are the actor's: replaying its routes keeps the gap at float32 level.
        assert row["rollout/train_logprob_abs_diff"] < 1e-4
