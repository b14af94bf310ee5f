"""Qwen3-MoE (and dense Qwen3) on megatron-core: conversion and parity with transformers in every EP layout.

One tiny random Qwen3-MoE checkpoint (4 experts of width 32, top-2 renormalised, layer 1
dense through mlp_only_layers, QK-norm, head_dim 32 != hidden / heads) and one dense
Qwen3. For each layout (TP, PP, EP) in (1,1,1), (1,1,2), (2,1,2) and (1,2,2):
- the model loaded from HF gives transformers' log-probs (fp32, < 1e-4);
- HF -> Megatron -> HF is bit-exact and every expert tensor comes back exactly once;
- each EP rank holds its own experts (E / ep local experts).
The 4-rank layouts are TP2 x EP2 and PP2 x EP2 (DP 2: the EP group spans the DP ranks).
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
    root = tmp_path_factory.mktemp("tiny_moe")
    return {
        "qwen3_moe": make_tiny_checkpoint(root / "qwen3_moe", "qwen3_moe", seed=5),
        "qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3", tie_word_embeddings=True, seed=6),
    }


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 100, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: hf_log_probs(path, tokens) for name, path in checkpoints.items()}


def _convert_and_run(layouts: list[tuple[int, int, int]], checkpoints: dict[str, str], tokens: torch.Tensor) -> dict:
    """For each (tp, pp, ep) layout and checkpoint: load, forward, export; per-rank results."""
    from safetensors.torch import load_file

    from megatron_dapo import parallel
    from megatron_dapo.models import adapter_for
    from megatron_dapo.models.parity import full_vocab_log_probs

    results = {}
    for tp, pp, ep in layouts:
        for name, directory in checkpoints.items():
            adapter = adapter_for(directory)
            dims = parallel.initialize_model_parallel(tp, pp, seed=0, ep=ep if adapter.hf.is_moe else 1)
            model = adapter.build_model(dims, dtype=torch.float32, init_weights=False)
            adapter.load_hf(model, directory, dims)
            model.eval()
            log_probs = full_vocab_log_probs(model, dims, tokens, adapter.hf.vocab_size)
            original = load_file(str(Path(directory) / "model.safetensors"))
            exported = list(adapter.export_hf(model, dims))
            local_experts = sorted({n.split(".local_experts.")[1].split(".")[0]
                                    for n, _ in model.named_parameters() if ".local_experts." in n})
            results[(tp, pp, ep, name)] = {
                "log_probs": log_probs,
                "exported_names": [n for n, _ in exported],
                "not_equal": sorted(n for n, t in exported if not torch.equal(t, original[n])),
                "expected_names": sorted(original),
                "local_experts": local_experts,
                "ep_rank": dims.ep_rank,
            }
    return results


def _check(results_by_rank: list[dict], layouts: list[tuple[int, int, int]],
           reference: dict[str, torch.Tensor]) -> dict[str, float]:
    errors = {}
    for (tp, pp, ep), name in [(layout, name) for layout in layouts for name in reference]:
        per_rank = [r[(tp, pp, ep, name)] for r in results_by_rank]
        last_stage = [r["log_probs"] for r in per_rank if r["log_probs"] is not None]
        assert len(last_stage) == len(results_by_rank) // pp
        for log_probs in last_stage:
            diff = (log_probs - reference[name]).abs().max().item()
            errors[f"{tp},{pp},{ep},{name}"] = diff
            assert diff < 1e-4, f"layout tp={tp} pp={pp} ep={ep} {name}: max |log p diff| {diff}"
        for r in per_rank:
            assert r["not_equal"] == [], (tp, pp, ep, name)
            assert len(r["exported_names"]) == len(set(r["exported_names"]))
            assert sorted(r["exported_names"]) == r["expected_names"]
            if name == "qwen3_moe":
                # 4 experts over ep ranks: local indices 0..4/ep-1 on every EP rank.
                assert r["local_experts"] == [str(j) for j in range(4 // ep)], (tp, pp, ep, r["local_experts"])
        if name == "qwen3_moe":
            names = per_rank[0]["exported_names"]
            # 3 sparse layers x 4 experts x (gate, up, down), in global expert order within a layer.
            experts = [n for n in names if ".mlp.experts." in n]
            assert len(experts) == 3 * 4 * 3
            assert experts[:6] == [f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"
                                   for e in (0, 1) for p in ("gate", "up", "down")]
            assert {r["ep_rank"] for r in per_rank} == set(range(ep))
    return errors


def test_single_rank(checkpoints, tokens, reference) -> None:
    layouts = [(1, 1, 1)]
    paths = {k: str(v) for k, v in checkpoints.items()}
    errors = _check(run_distributed(_convert_and_run, 1, layouts, paths, tokens), layouts, reference)
    assert errors and max(errors.values()) < 1e-4, errors


def test_two_ranks_ep2(checkpoints, tokens, reference) -> None:
    layouts = [(1, 1, 2)]
    paths = {k: str(v) for k, v in checkpoints.items()}
    errors = _check(run_distributed(_convert_and_run, 2, layouts, paths, tokens), layouts, reference)
    assert errors and max(errors.values()) < 1e-4, errors


def test_four_ranks_tp2xep2_pp2xep2(checkpoints, tokens, reference) -> None:
    layouts = [(2, 1, 2), (1, 2, 2)]
    paths = {k: str(v) for k, v in checkpoints.items()}
    out = run_distributed(_convert_and_run, 4, layouts, paths, tokens, timeout_s=300)
    errors = _check(out, layouts, reference)
    assert errors and max(errors.values()) < 1e-4, errors
