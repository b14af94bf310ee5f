"""Megatron GPTModel loaded by the adapters matches transformers, and HF -> Megatron -> HF is bit-exact.

Layouts (TP, PP, DP): (1,1,1), (2,1,1), (1,2,1), (1,1,2) and (2,2,1). Several layouts
share one spawned job (the groups are rebuilt in place) because spawning ranks and
importing megatron costs most of the runtime. Checkpoints: Qwen2 with untied embeddings
and Llama with tied ones (so PP=2 exercises the last stage's mirrored output layer).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from model_utils import hf_log_probs, make_tiny_checkpoint

pytestmark = pytest.mark.multirank

SEQ_LEN = 12
BATCH = 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_hf")
    return {
        "qwen2": make_tiny_checkpoint(root / "qwen2", "qwen2", seed=1),
        "llama_tied": make_tiny_checkpoint(root / "llama", "llama", tie_word_embeddings=True, seed=2),
    }


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 100, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: hf_log_probs(path, tokens) for name, path in checkpoints.items()}


def _convert_and_run(
    layouts: list[tuple[int, int]], checkpoints: dict[str, str], tokens: torch.Tensor
) -> dict:
    """For each (tp, pp) layout and checkpoint: load, forward, export; per-rank results."""
    from safetensors.torch import load_file

    from megatron_dapo import parallel
    from megatron_dapo.models import adapter_for
    from megatron_dapo.models.parity import full_vocab_log_probs

    results = {}
    for tp, pp in layouts:
        dims = parallel.initialize_model_parallel(tp, pp, seed=0)
        for name, directory in checkpoints.items():
            adapter = adapter_for(directory)
            model = adapter.build_model(dims, dtype=torch.float32, init_weights=False)
            adapter.load_hf(model, directory, dims)
            log_probs = full_vocab_log_probs(model, dims, tokens, adapter.hf.vocab_size)
            original = load_file(str(Path(directory) / "model.safetensors"))
            exported = list(adapter.export_hf(model, dims))
            results[(tp, pp, name)] = {
                "log_probs": log_probs,
                "exported_names": [n for n, _ in exported],
                "not_equal": sorted(n for n, t in exported if not torch.equal(t, original[n])),
                "expected_names": sorted(original),
                "vocab_rows": model.embedding.word_embeddings.weight.shape[0]
                if dims.is_first_stage
                else None,
            }
    return results


def check_layouts(
    results_by_rank: list[dict], layouts: list[tuple[int, int]], reference: dict[str, torch.Tensor]
) -> None:
    for (tp, pp), name in [(layout, name) for layout in layouts for name in reference]:
        per_rank = [r[(tp, pp, name)] for r in results_by_rank]
        last_stage = [r["log_probs"] for r in per_rank if r["log_probs"] is not None]
        world = len(results_by_rank)
        assert len(last_stage) == world // pp, (tp, pp, name)
        for log_probs in last_stage:
            diff = (log_probs - reference[name]).abs().max().item()
            assert diff < 1e-4, f"layout tp={tp} pp={pp} {name}: max |log p diff| {diff}"
        for r in per_rank:
            assert r["not_equal"] == [], (tp, pp, name)
            assert len(r["exported_names"]) == len(set(r["exported_names"]))
            assert sorted(r["exported_names"]) == r["expected_names"]
            # Megatron pads V=100 to Vp = 128 * tp rows, Vp / tp = 128 per TP rank.
            assert r["vocab_rows"] in (None, 128)
        assert per_rank[0]["exported_names"][0] == "model.embed_tokens.weight"


def test_single_rank_layout(checkpoints, tokens, reference) -> None:
    layouts = [(1, 1)]
    paths = {k: str(v) for k, v in checkpoints.items()}
    check_layouts(run_distributed(_convert_and_run, 1, layouts, paths, tokens), layouts, reference)


def test_two_rank_layouts_tp2_pp2_dp2(checkpoints, tokens, reference) -> None:
    layouts = [(2, 1), (1, 2), (1, 1)]
    paths = {k: str(v) for k, v in checkpoints.items()}
    check_layouts(run_distributed(_convert_and_run, 2, layouts, paths, tokens), layouts, reference)


def test_four_rank_layout_tp2_pp2(checkpoints, tokens, reference) -> None:
    layouts = [(2, 2)]
    paths = {k: str(v) for k, v in checkpoints.items()}
    check_layouts(run_distributed(_convert_and_run, 4, layouts, paths, tokens, timeout_s=300), layouts, reference)
