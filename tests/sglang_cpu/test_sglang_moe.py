"""SGLang's own CPU server (sglang 0.5.18) serving a tiny Qwen3-MoE: generation, expert updates by HF names.

The names and layout, read in the 0.5.18 wheel: update_weights_from_tensor hands the bucket
to the model's own ``load_weights`` (model_runner_components/weight_updater.py), and
Qwen3MoeForCausalLM.load_weights (models/qwen3_moe.py) maps the HF checkpoint's per-expert
names ``mlp.experts.{e}.{gate,up,down}_proj.weight`` through
``FusedMoE.make_expert_params_mapping`` onto its fused ``experts.w13_weight`` (gate as shard
w1 in the first half, up as w3 in the second) and ``experts.w2_weight``; the fused layer's
weight_loader copies each expert into its slice (layers/moe/fused_moe_triton/layer.py
_load_w13/_load_w2, skipping experts another EP rank holds). So the trainer sends exactly
what models/mapping.py exports, one expert at a time, never a fused tensor.

What 0.5.18 cannot serve: a Qwen3-MoE with dense layers. Its Qwen3MoeDecoderLayer sets
``is_layer_sparse = True`` for every layer ("Qwen3MoE all layers are sparse"), ignoring
mlp_only_layers and decoder_sparse_step, and load_weights drops the dense layer's
``mlp.{gate,up,down}_proj`` without a word. The module's server therefore serves an
all-sparse model (8 experts, top-2, renormalised; hidden 128, head_dim 32); the first test
holds the launch's refusal of a model with a dense layer and pins the reason in SGLang's
source (the served behaviour, measured once, is in its docstring).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from model_utils import make_server_moe, sampled_gaps, with_experts_of
from safetensors.torch import load_file
from tiers import requires, sglang_missing

from megatron_dapo.rollout.engine import GenerationResult, SamplingParams
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import SGLangServerConfig, sglang_python

pytestmark = [
    pytest.mark.sglang_cpu,
    *requires(sglang_missing()),
]

PROMPTS = [[5, 17, 42, 8], [3, 9], [60, 61, 62, 63, 64, 65]]


def launch(checkpoint: Path, log: Path, name: str, *, return_routes: bool = False) -> SGLangEngine:
    config = SGLangServerConfig(model_path=str(checkpoint), device="cpu", dtype="float32", max_total_tokens=32768,
                                host="127.0.0.1", log_path=str(log), return_routes=return_routes)
    return SGLangEngine.launch(config, name=name, vocab_size=100, startup_timeout_s=600)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang_moe")
    # All sparse: SGLang 0.5.18 serves no dense layer (the first test).
    made = {"a": make_server_moe(root / "a", seed=0, mlp_only_layers=[]),
            "b": make_server_moe(root / "b", seed=1, mlp_only_layers=[])}
    made["b_with_a_experts"] = with_experts_of(made["b"], made["a"], root / "b_with_a_experts")
    return made


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory):
    # With the routes (R3, issue 39): test_sglang_routes.py's row check runs on this server.
    engine = launch(checkpoints["a"], tmp_path_factory.mktemp("sglang_moe_log") / "sglang0.log", "sglang0",
                    return_routes=True)
    yield engine
    engine.shutdown()


def gaps(checkpoint: Path, results, temperature: float) -> torch.Tensor:
    return sampled_gaps(checkpoint, PROMPTS, results, temperature)


def sample(engine: SGLangEngine, temperature: float = 1.0) -> list[GenerationResult]:
    return engine.generate(PROMPTS, SamplingParams(n=2, temperature=temperature, max_new_tokens=12, seed=3))


def sync(engine: SGLangEngine, tensors: dict[str, torch.Tensor], version: int) -> None:
    """Layer-major buckets of 16 tensors: a layer's 24 expert tensors arrive over two or three of them."""
    names = sorted(tensors)
    for start in range(0, len(names), 16):
        engine.update_weights([(n, tensors[n]) for n in names[start : start + 16]])
    engine.finish_weight_update(version=version)


def test_sglang_0_5_18_serves_dense_layers_of_qwen3_moe_as_sparse_ones(tmp_path):
    """A Qwen3-MoE with a dense layer (mlp_only_layers=[1]) is refused before a server starts.

    Why, pinned in the installed SGLang's own source: Qwen3MoeDecoderLayer sets
    ``is_layer_sparse = True`` for every layer and never reads mlp_only_layers or
    decoder_sparse_step. Run on this server once (2026-11-25): served log-probs 4.4e-2 (mean)
    from transformers', and an update of layer 1's dense MLP changed nothing. The pin fails
    when an SGLang release reads those fields; then the refusal (server.check_servable) can go.
    """
    import subprocess

    from megatron_dapo.errors import UserError

    dense = make_server_moe(tmp_path / "dense", seed=0, mlp_only_layers=[1])
    try:
        launched = launch(dense, tmp_path / "refused.log", "refused")
    except UserError as err:
        assert re.search(r"Qwen3-MoE with dense layers \[1\].*use rollout\.engine=local or vllm", str(err)), err
    else:
        launched.shutdown()
        pytest.fail("a Qwen3-MoE with a dense layer was launched on SGLang")
    assert not (tmp_path / "refused.log").exists()
    origin = subprocess.run([sglang_python(), "-c", "import importlib.util; print(importlib.util.find_spec('sglang').origin)"],
                            capture_output=True, text=True, check=True).stdout.strip()
    source = (Path(origin).parent / "srt" / "models" / "qwen3_moe.py").read_text()
    assert "self.is_layer_sparse = True" in source
    assert "mlp_only_layers" not in source and "decoder_sparse_step" not in source


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_moe_log_probs_equal_transformers(engine, checkpoints, temperature):
    """Measured 2026-11-25: mean 1.7e-7, max 9.5e-7 at T = 1."""
    results = sample(engine, temperature)
    assert all(len(r.output_ids) == 12 for r in results)
    diff = gaps(checkpoints["a"], results, temperature)
    assert float(diff.mean()) < 5e-6 and float(diff.max()) < 5e-5, (float(diff.mean()), float(diff.max()))


def test_every_finished_row_carries_the_experts_the_model_routes_its_tokens_to(engine, checkpoints):
    """R3 (issue 39; test_sglang_routes.py says what is held): the server runs with
    --enable-return-routed-experts and every finished row carries the experts transformers' own
    routers choose for the same tokens. Here, not on a server of its own: the module's server
    holds checkpoint a until the expert update below."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from megatron_dapo.rollout.routes import HFRouteRecorder

    results = sample(engine)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoints["a"]), dtype=torch.float32,
                                                 experts_implementation="eager").eval()
    recorder = HFRouteRecorder(model)
    compared = 0
    for r in results:
        fed = [*PROMPTS[r.prompt_index], *r.output_ids][:-1]  # the last sampled token is never forwarded
        assert r.routed_experts is not None and r.routed_experts.dtype == np.uint8
        assert r.routed_experts.shape == (len(fed), 3, 2)
        with torch.no_grad():
            model(torch.tensor([fed]))
        own = recorder.take(1, len(fed))[0].numpy()
        assert np.array_equal(np.sort(r.routed_experts, -1), np.sort(own, -1)), r.sample_index
        compared += len(fed)
    assert compared > 60


def test_expert_updates_by_hf_names_serve_the_new_experts(engine, checkpoints):
    """The checkpoint's per-expert names go in as they are; each expert lands in its slice of w13/w2."""
    tensors = {k: load_file(str(checkpoints[k] / "model.safetensors")) for k in "ab"}
    experts = [n for n in tensors["b"] if ".mlp.experts." in n]
    assert len(experts) == 3 * 8 * 3  # every layer sparse x 8 experts x (gate, up, down)
    try:
        sync(engine, tensors["b"], version=1)
        results = sample(engine)
        assert {r.weight_versions for r in results} == {(1,)}
        assert float(gaps(checkpoints["b"], results, 1.0).max()) < 5e-5
        assert float(gaps(checkpoints["a"], results, 1.0).max()) > 1e-2
        # a's experts alone: every one of them replaces b's, nothing else moves.
        sync(engine, {n: tensors["a"][n] for n in experts}, version=2)
        results = sample(engine)
        assert float(gaps(checkpoints["b_with_a_experts"], results, 1.0).max()) < 5e-5
        assert float(gaps(checkpoints["b"], results, 1.0).max()) > 1e-2
    finally:
        sync(engine, tensors["a"], version=0)
    assert float(gaps(checkpoints["a"], sample(engine), 1.0).max()) < 5e-5
