"""A real SGLang server on a tiny random Qwen2: generation, log-probs, weight sync, release, abort.

GPU tier: needs CUDA and sglang (``pip install -e .[gpu]``); skipped elsewhere with the reason.
The log-prob checks allow 0.05 because the server runs bf16 kernels and the reference is an
fp32 transformers forward of the same weights; a weight update that did not land would
miss by far more (the two checkpoints are independent random models).
"""

import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("sglang", reason="sglang is not installed; `pip install -e .[gpu]` on a GPU machine")

from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

from megatron_dapo.rollout.engine import SamplingParams  # noqa: E402
from megatron_dapo.rollout.sglang.engine import SGLangEngine  # noqa: E402
from megatron_dapo.rollout.sglang.server import SGLangServerConfig  # noqa: E402
from megatron_dapo.rollout.weight_sync import sync_weights  # noqa: E402

PROMPTS = [[11, 12, 13, 14], [15, 16], [17, 18, 19, 20, 21, 22]]


def _checkpoint(path: Path, seed: int) -> torch.nn.Module:
    """head_dim 64 so every SGLang attention backend accepts it."""
    config = Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=2,
        initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.to(torch.bfloat16).save_pretrained(path)
    return model.float()


def _max_logprob_error(model: torch.nn.Module, results, temperature: float) -> float:
    worst = 0.0
    for r in results:
        prompt = PROMPTS[r.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + r.output_ids])).logits[0].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
        expected = logp.gather(-1, torch.tensor(r.output_ids).unsqueeze(-1)).squeeze(-1)
        worst = max(worst, (expected - torch.tensor(r.logprobs)).abs().max().item())
    return worst


def test_sglang_engine_end_to_end(tmp_path):
    first = _checkpoint(tmp_path / "first", seed=0)
    second = _checkpoint(tmp_path / "second", seed=1)
    config = SGLangServerConfig(
        model_path=str(tmp_path / "first"), host="127.0.0.1", mem_fraction_static=0.3,
        log_path=str(tmp_path / "sglang.log"), extra_args=("--disable-cuda-graph",),
    )  # fmt: skip
    engine = SGLangEngine.launch(config, name="gpu0", startup_timeout_s=600)
    try:
        params = SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=12)
        results = engine.generate(PROMPTS, params)
        assert [(r.prompt_index, r.sample_index) for r in results] == [(i, j) for i in range(3) for j in range(2)]
        assert all(1 <= len(r.output_ids) <= 12 and len(r.logprobs) == len(r.output_ids) for r in results)
        assert _max_logprob_error(first, results, 0.8) < 0.05

        # Colocated flow: release for training, resume, sync new weights through CUDA IPC.
        engine.release_memory()
        engine.resume_memory()
        export = ((n, t.to("cuda", torch.bfloat16)) for n, t in second.state_dict().items())
        stats = sync_weights(export, [engine], is_controller=True, bucket_bytes=256 * 1024)
        assert stats.num_tensors == len(second.state_dict()) and stats.num_buckets > 1
        greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
        assert _max_logprob_error(second, greedy, 1.0) < 0.05
        assert _max_logprob_error(first, greedy, 1.0) > 0.5

        out = {}
        long = SamplingParams(temperature=1.0, max_new_tokens=1500, stop_token_ids=())
        thread = threading.Thread(target=lambda: out.setdefault("r", engine.generate(PROMPTS * 8, long)))
        thread.start()
        time.sleep(1.0)
        engine.abort()
        thread.join(timeout=120)
        assert any(r.finish_reason == "abort" for r in out["r"])
        assert engine.health() is True
    finally:
        engine.shutdown()
    assert engine.process is not None and engine.process.returncode is not None
