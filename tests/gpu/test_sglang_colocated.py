"""Colocated SGLang engines for real: leader ranks launch, CUDA IPC weight sync from every GPU.

GPU tier: needs CUDA and sglang; the 2-rank case also needs 2 GPUs (one engine at TP=2 whose
workers each open the handle of the training rank on their own GPU). After the sync from a
second, independent random checkpoint, greedy log-probs must match that checkpoint (0.05:
bf16 server vs fp32 reference) and miss the first by far, so a bucket that did not land, or
landed on the wrong TP rank, fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

pytestmark = pytest.mark.gpu
pytest.importorskip("sglang", reason="sglang is not installed; `pip install -e .[gpu]` on a GPU machine")

PROMPTS = [[11, 12, 13, 14], [15, 16], [17, 18, 19, 20, 21, 22]]


def _checkpoint(path: Path, seed: int) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=2,
        initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16).save_pretrained(path)


def _greedy_logprob_error(path: Path, results) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worst = 0.0
    for r in results:
        prompt = PROMPTS[r.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + r.output_ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
        expected = logp.gather(-1, torch.tensor(r.output_ids).unsqueeze(-1)).squeeze(-1)
        worst = max(worst, (expected - torch.tensor(r.logprobs)).abs().max().item())
    return worst


def _launch_and_sync(first: str, second: str, log_dir: str, tp: int) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_dapo.config import RolloutConfig
    from megatron_dapo.rollout.engine import SamplingParams
    from megatron_dapo.rollout.sglang.launch import launch_colocated_engines

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method="env://")
    config = RolloutConfig(engine="sglang", tensor_model_parallel_size=tp, gpu_memory_utilization=0.3,
                           host="127.0.0.1")
    engines = launch_colocated_engines(config, first, rank=rank, world_size=dist.get_world_size(), local_rank=rank,
                                       log_dir=log_dir, startup_timeout_s=600)
    try:
        engines.release_memory()
        engines.resume_memory()
        weights = load_file(str(Path(second) / "model.safetensors"))
        export = ((n, t.to(f"cuda:{rank}")) for n, t in sorted(weights.items()))
        stats = engines.sync_weights(export, bucket_bytes=256 * 1024)
        out = {"num_tensors": stats.num_tensors, "expected_tensors": len(weights), "num_buckets": stats.num_buckets}
        if rank == 0:
            greedy = SamplingParams(temperature=0, max_new_tokens=8)
            out["results"] = [r for c in engines.clients for r in c.generate(PROMPTS, greedy)]
            out["num_clients"] = len(engines.clients)
        dist.barrier()
        return out
    finally:
        engines.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_colocated_engines_sync_through_cuda_ipc(tmp_path: Path, tp: int) -> None:
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs, {torch.cuda.device_count()} visible")
    _checkpoint(tmp_path / "first", seed=0)
    _checkpoint(tmp_path / "second", seed=1)
    ranks = run_distributed(_launch_and_sync, tp, str(tmp_path / "first"), str(tmp_path / "second"),
                            str(tmp_path / "logs"), tp, timeout_s=900, device_kind="cuda")
    for r in ranks:
        assert r["num_tensors"] == r["expected_tensors"] and r["num_buckets"] > 1
    assert ranks[0]["num_clients"] == 1
    results = ranks[0]["results"]
    assert _greedy_logprob_error(tmp_path / "second", results) < 0.05
    assert _greedy_logprob_error(tmp_path / "first", results) > 0.5
