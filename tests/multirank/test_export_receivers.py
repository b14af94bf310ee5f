"""export_hf(receivers="controller"): rank 0 alone receives the model, the same tensors as every rank does with "all";
receivers="stages": each pipeline stage's first rank receives its own stage's part, no byte crosses stages.

Four gloo ranks, tiny checkpoints: Qwen2 untied at TP2 x PP2 (padded vocab rows, lm_head on
the last stage) and at TP2 x DP2 (the second replica holds copies and must send nothing),
Qwen3-MoE at PP2 x EP2 and TP2 x EP2 (experts from their EP owners, the EP group spanning
DP ranks). Rank 0's controller export equals the "all" export name for name, in the same
order, bit for bit; the other ranks yield nothing; every shard crosses the wire once (bytes
sent = model bytes minus rank 0's own shards' bytes, counted at dist.send).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank


def _export_both_ways(layouts: list[tuple[int, int, int, str]]) -> dict:
    import torch.distributed as dist

    from megatron_dapo import parallel
    from megatron_dapo.models import adapter_for

    sent = {"bytes": 0, "calls": 0, "dsts": set()}
    send = dist.send

    def counting_send(tensor: torch.Tensor, dst: int, *args, **kwargs):
        sent["bytes"] += tensor.numel() * tensor.element_size()
        sent["calls"] += 1
        sent["dsts"].add(dst)
        return send(tensor, dst, *args, **kwargs)

    dist.send = counting_send
    results = {}
    try:
        for tp, pp, ep, directory in layouts:
            adapter = adapter_for(directory)
            dims = parallel.initialize_model_parallel(tp, pp, seed=0, ep=ep)
            model = adapter.build_model(dims, dtype=torch.float32, init_weights=False)
            adapter.load_hf(model, directory, dims)
            everywhere = [(n, t.clone()) for n, t in adapter.export_hf(model, dims, receivers="all")]
            sent.update(bytes=0, calls=0, dsts=set())
            controller = [(n, t.clone()) for n, t in adapter.export_hf(model, dims, receivers="controller")]
            controller_sent = dict(sent)
            sent.update(bytes=0, calls=0, dsts=set())
            stages = [(n, t.clone()) for n, t in adapter.export_hf(model, dims, receivers="stages")]
            params = dict(model.named_parameters())
            own = sum(params[tm.mcore_name].numel() * params[tm.mcore_name].element_size()
                      for tm in adapter.tensor_maps(model, dims) if not tm.mirror)
            vocab_tensors = 1 if adapter.hf.tie_word_embeddings else 2
            padding = (adapter.padded_vocab_size(tp) - adapter.hf.vocab_size) * adapter.hf.hidden_size * 4 * vocab_tensors
            results[(tp, pp, ep)] = {
                "all": everywhere, "controller": controller, "sent": controller_sent, "dp_rank": dims.dp_rank,
                "stages": stages, "stages_sent": dict(sent), "pp_rank": dims.pp_rank, "rank": dims.rank,
                "stage_source": parallel.stage_source(dims, dims.pp_rank),
                "own_bytes": own, "padding_bytes": padding, "model_bytes": sum(t.numel() * t.element_size() for _, t in everywhere),
            }
    finally:
        dist.send = send
    return results


def test_controller_export_equals_export_to_all_and_sends_each_shard_once(tmp_path: Path) -> None:
    qwen2 = str(make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", seed=7))
    moe = str(make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", seed=8))
    layouts = [(2, 2, 1, qwen2), (2, 1, 1, qwen2), (1, 2, 2, moe), (2, 1, 2, moe)]
    ranks = run_distributed(_export_both_ways, 4, layouts, timeout_s=400)
    for tp, pp, ep, _ in layouts:
        layout = (tp, pp, ep)
        r0 = ranks[0][layout]
        assert [n for n, _ in r0["controller"]] == [n for n, _ in r0["all"]], layout
        assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(r0["controller"], r0["all"])), layout
        assert r0["sent"]["calls"] == 0, layout
        for rank in ranks[1:]:
            assert rank[layout]["controller"] == [], layout
        total = sum(rank[layout]["sent"]["bytes"] for rank in ranks)
        # One copy of every shard (the vocab tensors with their padding rows), less rank 0's own.
        assert total == r0["model_bytes"] + r0["padding_bytes"] - r0["own_bytes"], (layout, total)
        if pp == 1 and ep == 1:  # DP 2: the second replica's copies stay home
            assert all(rank[layout]["sent"]["bytes"] == 0 for rank in ranks if rank[layout]["dp_rank"] == 1), layout
        # "stages": the stages' first ranks hold, in stage order, exactly the controller's export.
        sources = sorted({rank[layout]["stage_source"] for rank in ranks})
        assert sources == [s * (4 // pp) for s in range(pp)], layout
        # stage_source's rule (PP outermost in megatron's order): the rank it names holds stage s.
        assert [ranks[src][layout]["pp_rank"] for src in sources] == list(range(pp)), layout
        staged = [item for src in sources for item in ranks[src][layout]["stages"]]
        assert [n for n, _ in staged] == [n for n, _ in r0["all"]], layout
        assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(staged, r0["all"])), layout
        for rank in ranks:
            result = rank[layout]
            if result["rank"] not in sources:
                assert result["stages"] == [], layout
            # Every shard goes to its own stage's first rank: none crosses to another stage.
            assert result["stages_sent"]["dsts"] <= {result["stage_source"]} - {result["rank"]}, (layout, result["rank"])
        if pp == 2:
            stage0, stage1 = ([n for n, _ in ranks[src][layout]["stages"]] for src in sources)
            assert "model.embed_tokens.weight" in stage0 and "model.norm.weight" in stage1, layout
            assert not any("model.layers.0." in n for n in stage1), layout



def _gather_vocab_peak(rows: int, hidden: int) -> dict:
    """One vocab-parallel tensor gathered by the 'all' export on gloo: its values and the peak RSS it added."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_dapo import parallel
    from megatron_dapo.models import mapping
    from megatron_dapo.models.export import _gather_hf

    rank = parallel.init_distributed("cpu").rank
    local = torch.full((rows, hidden), float(rank + 1))
    tm = mapping.TensorMap(mcore_name="embedding.word_embeddings.weight", hf_names=("model.embed_tokens.weight",),
                           kind="vocab", sort_key=(0, 0))
    dims = SimpleNamespace(tp=2, tp_rank=rank, tp_group=dist.group.WORLD, rank=rank)
    hf = SimpleNamespace(vocab_size=2 * rows - 3)
    status = Path("/proc/self/status")

    def field(name: str) -> int:
        return next(int(line.split()[1]) * 1024 for line in status.read_text().splitlines() if line.startswith(name))

    before = field("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    (full,) = _gather_hf(hf, tm, local, dims)
    added = field("VmHWM:") - before
    expected = torch.cat([torch.full((rows, hidden), 1.0), torch.full((rows, hidden), 2.0)])[: hf.vocab_size]
    return {"equal": torch.equal(full, expected), "added": added, "full_bytes": 2 * rows * hidden * 4}


def test_vocab_gather_on_gloo_holds_the_tensor_once() -> None:
    # DESIGN.md, "Rules where the device, the backend or the launcher matters": gloo's
    # all_gather_into_tensor would add a flat temporary of the whole tensor (2x at the peak).
    for result in run_distributed(_gather_vocab_peak, 2, 8192, 2048, timeout_s=120):  # 64 MiB gathered, fp32
        assert result["equal"]
        assert result["added"] < 1.4 * result["full_bytes"], result
