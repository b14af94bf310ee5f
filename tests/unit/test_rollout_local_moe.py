"""The local engine on Qwen3 (QK-norm) and Qwen3-MoE: transformers' log-probs, and expert weights by HF names.

The MoE checkpoints have 8 experts, top-2, and dense layers where Qwen3MoeForCausalLM puts
them: layer 1 through mlp_only_layers (norm_topk_prob true) or every other layer through
decoder_sparse_step 2 (norm_topk_prob false: the full softmax's top-k values). The engine
decodes in continuous batches with its own attention (rollout/local/attention.py) and
left-padded rows whose padding also passes the routers; the reference is transformers' own
model on each whole sequence, with eager attention and eager experts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_utils import make_tiny_checkpoint
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.local.attention import ATTENTION
from megatron_dapo.rollout.local.engine import LocalEngine

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [20]]
MOE = {
    "mlp_only_layers": {"num_experts": 8, "mlp_only_layers": [1]},
    "sparse_step_2": {"num_experts": 8, "mlp_only_layers": [], "decoder_sparse_step": 2, "norm_topk_prob": False},
}
# Most |engine - transformers| log-prob gap allowed per dtype (measured: 8.9e-16 and 6.8e-7).
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("local_moe")
    made = {name: make_tiny_checkpoint(root / name, "qwen3_moe", num_layers=4, moe=moe, seed=11)
            for name, moe in MOE.items()}
    made["qwen3"] = make_tiny_checkpoint(root / "qwen3", "qwen3", num_layers=2, seed=12)
    return made


def _reference(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    # transformers' sdpa, not eager: eager attention takes its softmax in float32 whatever the
    # dtype, which alone put float64 runs 1.8e-7 apart.
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                experts_implementation="eager").eval()


def _gaps(reference: torch.nn.Module, results, temperature: float) -> torch.Tensor:
    gaps = []
    for r in results:
        prompt = PROMPTS[r.prompt_index]
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + r.output_ids])).logits[0]  # [S, V]
        logp = torch.log_softmax(logits.double() / temperature, dim=-1)[len(prompt) - 1 : -1]
        expected = logp.gather(-1, torch.tensor(r.output_ids).unsqueeze(-1)).squeeze(-1)
        gaps.append((expected - torch.tensor(r.logprobs, dtype=torch.float64)).abs())
    return torch.cat(gaps)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("model", ["mlp_only_layers", "sparse_step_2", "qwen3"])
def test_log_probs_equal_transformers(checkpoints, model, dtype):
    path = checkpoints[model]
    reference = _reference(path, dtype)
    if model != "qwen3":  # both kinds of MLP are exercised
        kinds = [type(layer.mlp).__name__ for layer in reference.model.layers]
        sparse = [1, 3] if model == "sparse_step_2" else [0, 2, 3]
        assert [i for i, k in enumerate(kinds) if k == "Qwen3MoeSparseMoeBlock"] == sparse, kinds
    engine = LocalEngine(path, dtype=dtype, max_batch_size=3)  # rows join as others leave
    assert engine.model.config._attn_implementation == ATTENTION
    for temperature in (1.0, 0.7):
        results = engine.generate(PROMPTS, SamplingParams(n=2, temperature=temperature, max_new_tokens=10, seed=3))
        assert len(results) == 8 and all(len(r.output_ids) == 10 for r in results)
        gaps = _gaps(reference, results, temperature)
        assert float(gaps.max()) < TOLERANCE[dtype], (model, dtype, temperature, float(gaps.max()))


def test_moe_rows_sample_the_same_alone_or_batched(checkpoints):
    """Left padding passes the routers too: a row's tokens must not depend on its batch mates."""
    path = checkpoints["mlp_only_layers"]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=5)
    alone = LocalEngine(path, dtype=torch.float64, max_batch_size=1).generate(PROMPTS, params)
    batched = LocalEngine(path, dtype=torch.float64, max_batch_size=12).generate(PROMPTS, params)
    assert [r.output_ids for r in alone] == [r.output_ids for r in batched]
    gap = max(abs(a - b) for x, y in zip(alone, batched) for a, b in zip(x.logprobs, y.logprobs))
    assert gap < 1e-12


def test_expert_weights_update_by_hf_checkpoint_names(checkpoints):
    """An engine built without weights takes the checkpoint's per-expert tensors and equals transformers' load."""
    path = checkpoints["mlp_only_layers"]
    tensors = load_file(str(path / "model.safetensors"))
    experts = sorted(n for n in tensors if ".mlp.experts." in n)
    assert len(experts) == 3 * 8 * 3  # 3 sparse layers x 8 experts x (gate, up, down)
    engine = LocalEngine(path, load_weights=False)
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(ValueError, match=rf"unknown tensor '{fused}'"):  # only the checkpoint's names
        engine.update_weights([(fused, torch.zeros(8, 64, 64))])
    with pytest.raises(ValueError, match=r"unknown tensor 'model.layers.0.mlp.experts.8.gate_proj.weight'"):
        engine.update_weights([("model.layers.0.mlp.experts.8.gate_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(ValueError, match=r"'model.layers.2.mlp.experts.5.down_proj.weight' has shape \(32, 64\) "
                                         r"but the model expects \(64, 32\)"):
        engine.update_weights([("model.layers.2.mlp.experts.5.down_proj.weight", torch.zeros(32, 64))])
    # Layer by layer in buckets, one expert's up projection held back: it is named.
    names = sorted(tensors)
    missing = "model.layers.2.mlp.experts.5.up_proj.weight"
    for start in range(0, len(names), 7):
        engine.update_weights([(n, tensors[n]) for n in names[start : start + 7] if n != missing])
    with pytest.raises(ValueError, match=rf"missed 1 parameters, e\.g\. \['{missing}'\]"):
        engine.finish_weight_update()
    engine.update_weights([(missing, tensors[missing])])
    engine.finish_weight_update(version=4)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    received = engine.model.state_dict()
    assert sorted(received) == sorted(loaded)
    assert [n for n in loaded if not torch.equal(received[n], loaded[n])] == []
    # Only the named slice changes: an update of one expert's gate leaves its up rows and its neighbours.
    gate_up = received["model.layers.0.mlp.experts.gate_up_proj"].clone()  # [E, 2F, H]
    engine.update_weights([("model.layers.0.mlp.experts.3.gate_proj.weight", torch.ones(32, 64))])
    after = engine.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(after[3, :32], torch.ones(32, 64))
    changed = (after != gate_up).any(-1)  # [E, 2F]: rows that changed
    assert changed.nonzero()[:, 0].unique().tolist() == [3] and changed[3, 32:].sum() == 0
