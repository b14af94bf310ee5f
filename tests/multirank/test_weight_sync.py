"""Weight sync from a sharded Megatron model into the local engine is lossless and bounded.

Two gloo ranks hold a tiny model at TP=2 (Qwen2, untied) and at PP=2 (Llama, tied
embeddings, so the last stage's mirrored output layer is exercised). Both ranks run
``sync_weights(adapter.export_hf(...))``; only rank 0 owns an engine, built from
config.json alone (random weights). Afterwards the engine's state dict equals the HF export
and the original checkpoint bit for bit, and the bucketer never held more than one bucket
plus one tensor, a small fraction of the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank

BUCKET_BYTES = 48 * 1024


def _sync_layouts(layouts: list[tuple[int, int, str]]) -> dict:
    """Per layout: load the checkpoint into Megatron, sync into a fresh LocalEngine on rank 0."""
    from safetensors.torch import load_file

    from megatron_dapo import parallel
    from megatron_dapo.models import adapter_for
    from megatron_dapo.rollout.engine import SamplingParams
    from megatron_dapo.rollout.local.engine import LocalEngine
    from megatron_dapo.rollout.weight_sync import sync_weights

    results = {}
    for tp, pp, directory in layouts:
        dims = parallel.initialize_model_parallel(tp, pp, seed=0)
        adapter = adapter_for(directory)
        model = adapter.build_model(dims, dtype=torch.float32, init_weights=False)
        adapter.load_hf(model, directory, dims)
        engine = LocalEngine(directory, load_weights=False) if dims.is_controller else None
        stats = sync_weights(
            adapter.export_hf(model, dims), [engine] if engine else [], is_controller=dims.is_controller,
            bucket_bytes=BUCKET_BYTES,
        )  # fmt: skip
        export = {n: t.clone() for n, t in adapter.export_hf(model, dims)}  # collective: every rank
        result = {"stats": stats}
        if engine is not None:
            received = engine.model.state_dict()
            original = load_file(str(Path(directory) / "model.safetensors"))
            greedy = SamplingParams(temperature=0, max_new_tokens=6)
            prompts = [[1, 2, 3], [4, 5]]
            result.update(
                names=sorted(export),
                original_names=sorted(original),
                differ_from_export=sorted(n for n, t in export.items() if not torch.equal(received[n], t)),
                differ_from_original=sorted(n for n, t in original.items() if not torch.equal(received[n], t)),
                model_bytes=sum(t.nbytes for t in export.values()),
                largest_tensor=max(t.nbytes for t in export.values()),
                greedy_synced=[r.output_ids for r in engine.generate(prompts, greedy)],
                greedy_checkpoint=[r.output_ids for r in LocalEngine(directory).generate(prompts, greedy)],
            )
        results[(tp, pp)] = result
    return results


def test_sync_from_tp2_and_pp2_into_local_engine_is_bit_exact(tmp_path: Path) -> None:
    qwen2 = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", seed=4)
    llama = make_tiny_checkpoint(tmp_path / "llama", "llama", tie_word_embeddings=True, seed=5)
    rank0, rank1 = run_distributed(_sync_layouts, 2, [(2, 1, str(qwen2)), (1, 2, str(llama))], timeout_s=300)
    for layout in [(2, 1), (1, 2)]:
        r = rank0[layout]
        assert r["names"] == r["original_names"], layout
        assert r["differ_from_export"] == [] and r["differ_from_original"] == [], layout
        assert r["greedy_synced"] == r["greedy_checkpoint"], layout
        stats = r["stats"]
        assert stats.num_tensors == len(r["names"])
        assert stats.num_bytes == r["model_bytes"]
        # About one bucket held, never the model: bucket + the incoming tensor at most.
        assert stats.peak_bucket_bytes <= BUCKET_BYTES + r["largest_tensor"]
        assert stats.peak_bucket_bytes < r["model_bytes"] / 4
        assert stats.num_buckets >= r["model_bytes"] // (BUCKET_BYTES + r["largest_tensor"])
        assert (rank1[layout]["stats"].num_tensors, rank1[layout]["stats"].num_buckets) == (0, 0)
