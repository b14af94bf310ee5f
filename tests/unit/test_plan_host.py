"""plan/host.py: the converter's and the weight export's memory, by hand for the flagship's shapes.

The numbers these formulas give were checked against measurements of the real shapes at 2
layers (benchmarks/scale.py, docs/benchmarks.md, 2026-11-25): converter 1.92 GiB measured.
"""

from __future__ import annotations

import json

from megatron_dapo.plan import host
from megatron_dapo.plan.dims import MODEL_CONFIG_DIR, ModelDims
from megatron_dapo.rollout.host_arena import BLOCK_BYTES


def _dims(name: str, **changes: object) -> ModelDims:
    raw = json.loads((MODEL_CONFIG_DIR / f"{name}.json").read_text())
    raw.update(changes)
    return ModelDims.from_hf(raw, name, "test")


def test_qwen32b_converter_peak_is_imports_plus_the_padded_embedding_at_any_depth() -> None:
    for layers in (2, 64):
        dims = _dims("Qwen2.5-32B", num_hidden_layers=layers)
        peak, formula = host.converter_peak_bytes(dims, tp=8)
        assert host.padded_vocab(dims, 8) == 152_576  # 152,064 rounded up to 1024
        assert peak == host.IMPORT_BASELINE_BYTES + 152_576 * 5120 * 2
        assert "V_pad x h" in formula


def test_a_layer_larger_than_the_embedding_sets_the_converter_peak_but_experts_count_one_by_one() -> None:
    dense = _dims("Qwen2.5-32B", num_hidden_layers=2, vocab_size=1024)
    assert host.converter_peak_bytes(dense, tp=1)[0] == host.IMPORT_BASELINE_BYTES + dense.layer_params() * 2
    moe = _dims("Qwen3-30B-A3B", num_hidden_layers=2)
    assert moe.layer_params(sparse=True) * 2 > host.padded_vocab(moe, 1) * 2048 * 2  # a whole layer would set it
    assert host.converter_peak_bytes(moe, tp=1)[0] == host.IMPORT_BASELINE_BYTES + 151_936 * 2048 * 2  # 1187 x 128: no padding


def test_export_transient_is_the_largest_tensor_a_receiver_builds() -> None:
    dims = _dims("Qwen2.5-32B")
    assert host.export_transient_bytes(dims, 8)[0] == 152_576 * 5120 * 2  # > 2 x 2F x h x 2 B = 1.13 GB
    narrow = _dims("Qwen2.5-32B", vocab_size=1024)
    assert host.export_transient_bytes(narrow, 8)[0] == 2 * 2 * 27648 * 5120 * 2
    assert host.export_transient_bytes(narrow, 1)[0] == 0  # TP 1, PP 1: views of the parameters
    # TP 1 x PP 2: the other stage's tensors arrive whole; the controller of a tied model receives no vocab.
    assert host.export_transient_bytes(dims, 1, pp=2)[0] == 152_064 * 5120 * 2
    assert host.export_transient_bytes(narrow, 1, pp=2)[0] == 2 * 27648 * 5120 * 2
    tied = _dims("Qwen2.5-32B", tie_word_embeddings=True)
    assert host.export_transient_bytes(tied, 1, pp=2, receivers="controller")[0] == 2 * 27648 * 5120 * 2
    assert host.export_transient_bytes(tied, 1, pp=2, receivers="all")[0] == 152_064 * 5120 * 2
    moe = _dims("Qwen3-30B-A3B", num_hidden_layers=2)
    assert host.export_transient_bytes(moe, 1, ep=8, receivers="controller")[0] == 2 * 768 * 2048 * 2  # one expert


def test_the_restart_copy_is_one_model_per_engine_leader() -> None:
    """Issue 39 item 6: leaders kept two host copies at the peak of every sync (61 GB each for 32B);
    now one reused copy, which the plan counts per leader and node."""
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.plan import GPUS, format_plan, make_plan, resolve_model
    from megatron_dapo.plan.host import restart_copy_bytes

    cfg = load_config(str(MODEL_CONFIG_DIR.parent / "dapo_qwen3_30b_a3b.yaml"))
    dims = resolve_model(cfg)
    # One copy of the model in exactly pinned blocks (rollout/host_arena.py), + at most one block's tail.
    assert restart_copy_bytes(dims) == dims.num_params() * 2 + BLOCK_BYTES
    plan = make_plan(cfg, dims, nodes=4, gpus_per_node=8, hardware=GPUS["h100"])
    line = [row for row in format_plan(plan).splitlines() if row.startswith("  engine restarts")]
    assert len(line) == 1 and "x 2 leader(s) per node = 115.74 GiB" in line[0]
