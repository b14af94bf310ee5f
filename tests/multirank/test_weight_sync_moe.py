"""Weight sync of a Qwen3-MoE into an engine: lossless, in the engines' names, and bounded by one bucket.

Two gloo ranks hold a tiny Qwen3-MoE (8 experts of width 64, top-2, layer 1 dense) at EP=2
(each rank owns 4 experts of every sparse layer) and at TP=2 (ETP=2: every expert is split
over both ranks). Both ranks run ``sync_weights(adapter.export_hf(...))`` with buckets of
48 KiB, an eighth of one layer's experts (384 KiB); rank 0 owns a LocalEngine built from
config.json alone. What is held:
- the engine ends bit-exact with the checkpoint, and so do its greedy tokens;
- experts arrive one tensor per expert and projection under the HF checkpoint's names, layer
  by layer and expert by expert (the order vLLM's layerwise reload completes a layer in, and
  the names vLLM's and SGLang's Qwen3-MoE loaders map onto their fused experts), never as a
  fused [E, ...] tensor;
- memory: the exported tensors still alive at any moment (weak references to everything the
  export yielded that is not a parameter) never exceed one bucket plus two tensors (the
  export keeps an fc1's gate and up together), and no collective moves more than one expert's
  fc1, so a layer's experts never exist at once beyond the model.
Both export destinations: every rank receiving (colocated engines) and the controller alone
(the other rank sends its experts; it yields nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank

BUCKET_BYTES = 48 * 1024
MOE = {"num_experts": 8, "moe_intermediate_size": 64, "mlp_only_layers": [1]}
EXPERT_TENSOR_BYTES = 64 * 64 * 4  # [F, H] float32
LAYER_EXPERT_BYTES = 8 * 3 * EXPERT_TENSOR_BYTES


class _Collectives:
    """Records the largest bytes one broadcast / all_gather / recv moved since the last ``pop``, while installed."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._saved = {"broadcast": dist.broadcast, "all_gather": dist.all_gather, "recv": dist.recv}
        self._largest = 0

    def pop(self) -> int:
        largest, self._largest = self._largest, 0
        return largest

    def __enter__(self) -> _Collectives:
        def broadcast(tensor, *args, **kwargs):
            self._largest = max(self._largest, tensor.nbytes)
            return self._saved["broadcast"](tensor, *args, **kwargs)

        def all_gather(tensors, tensor, *args, **kwargs):
            self._largest = max(self._largest, sum(t.nbytes for t in tensors))
            return self._saved["all_gather"](tensors, tensor, *args, **kwargs)

        def recv(tensor, *args, **kwargs):
            self._largest = max(self._largest, tensor.nbytes)
            return self._saved["recv"](tensor, *args, **kwargs)

        self._dist.broadcast, self._dist.all_gather, self._dist.recv = broadcast, all_gather, recv
        return self

    def __exit__(self, *exc: object) -> None:
        self._dist.broadcast, self._dist.all_gather, self._dist.recv = (
            self._saved["broadcast"], self._saved["all_gather"], self._saved["recv"])


def _metered(named_tensors, param_storages: set[int], collectives: _Collectives, record: dict):
    """Pass the export through, noting its order, the largest collective that made each tensor (those
    since the previous one), and the bytes of yielded tensors still alive at each step."""
    import weakref

    alive: list[tuple[weakref.ref, int]] = []
    for name, tensor in named_tensors:
        record["collective_bytes"].append((name, collectives.pop()))
        alive = [(ref, size) for ref, size in alive if ref() is not None]
        if tensor.untyped_storage().data_ptr() not in param_storages:  # a parameter's view costs nothing
            alive.append((weakref.ref(tensor), tensor.nbytes))
        record["peak_alive"] = max(record["peak_alive"], sum(size for _, size in alive))
        record["order"].append((name, tuple(tensor.shape)))
        yield name, tensor
        del tensor


def _sync(layouts: list[tuple[int, int, str]], directory: str) -> dict:
    from safetensors.torch import load_file

    from megatron_dapo import parallel
    from megatron_dapo.models import adapter_for
    from megatron_dapo.models.adapter import unwrap_model
    from megatron_dapo.rollout.engine import SamplingParams
    from megatron_dapo.rollout.local.engine import LocalEngine
    from megatron_dapo.rollout.weight_sync import sync_weights

    results = {}
    for tp, ep, receivers in layouts:
        adapter = adapter_for(directory)
        dims = parallel.initialize_model_parallel(tp, 1, seed=0, ep=ep, num_experts=8)
        model = adapter.build_model(dims, dtype=torch.float32, init_weights=False)
        adapter.load_hf(model, directory, dims)
        storages = {p.untyped_storage().data_ptr() for p in unwrap_model(model).parameters()}
        engine = LocalEngine(directory, load_weights=False) if dims.is_controller else None
        record = {"peak_alive": 0, "order": [], "collective_bytes": []}
        with _Collectives() as collectives:
            stats = sync_weights(_metered(adapter.export_hf(model, dims, receivers=receivers), storages, collectives, record),
                                 [engine] if engine else [], is_controller=dims.is_controller,
                                 bucket_bytes=BUCKET_BYTES)
        result = {"stats": stats, **record}
        if engine is not None:
            original = load_file(str(Path(directory) / "model.safetensors"))
            received = engine.model.state_dict()
            engine_view = dict(engine._tensors)  # the engine's HF names (experts as views of its fused tensors)
            greedy = SamplingParams(temperature=0, max_new_tokens=8)
            result.update(
                differ=sorted(n for n, t in original.items() if not torch.equal(engine_view[n], t)),
                engine_names=sorted(engine_view),
                original_names=sorted(original),
                fused=sorted(n for n in received if n.endswith(("experts.gate_up_proj", "experts.down_proj"))),
                greedy_synced=[r.output_ids for r in engine.generate([[1, 2, 3], [4, 5]], greedy)],
                greedy_checkpoint=[r.output_ids for r in LocalEngine(directory).generate([[1, 2, 3], [4, 5]],
                                                                                         greedy)],
            )
        results[(tp, ep, receivers)] = result
    return results


def test_moe_sync_at_ep2_and_etp2_is_exact_ordered_and_bounded(tmp_path: Path) -> None:
    directory = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", num_layers=3, moe=MOE, seed=7)
    # (tp, ep, receivers): EP 2, then TP 2 with ETP 2; every rank receiving, then the controller alone
    layouts = [(1, 2, "all"), (2, 1, "all"), (1, 2, "controller"), (2, 1, "controller")]
    rank0, rank1 = run_distributed(_sync, 2, layouts, str(directory), timeout_s=300)
    expected_experts = [(f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight", (64, 64))
                        for layer in (0, 2) for e in range(8) for p in ("gate", "up", "down")]
    for layout in layouts:
        r = rank0[layout]
        assert r["differ"] == [] and r["engine_names"] == r["original_names"], layout
        assert len(r["fused"]) == 4  # the engine's own fused tensors (2 sparse layers), filled expert by expert
        assert r["greedy_synced"] == r["greedy_checkpoint"], layout
        if layout[2] == "controller":
            assert rank1[layout]["order"] == [], layout  # it only sent its shards
        for rank in (rank0, rank1) if layout[2] == "all" else (rank0,):  # every receiver iterates the same stream
            order = rank[layout]["order"]
            assert [o for o in order if ".mlp.experts." in o[0]] == expected_experts, layout
            # Layer-major: all of layer 0 (experts last), then layer 1, ...
            layers = [int(n.split(".")[2]) for n, _ in order if n.startswith("model.layers.")]
            assert layers == sorted(layers), layout
            moved = [size for name, size in rank[layout]["collective_bytes"] if ".mlp.experts." in name]
            assert 0 < max(moved) <= 2 * EXPERT_TENSOR_BYTES, layout  # one expert's gate + up at most
        stats = r["stats"]
        assert stats.num_tensors == len(r["original_names"]) and stats.num_buckets > 8
        bound = BUCKET_BYTES + 2 * EXPERT_TENSOR_BYTES
        assert stats.peak_bucket_bytes <= bound, (layout, stats.peak_bucket_bytes)
        assert r["peak_alive"] <= bound, (layout, r["peak_alive"])  # the engine keeps no reference either
        assert r["peak_alive"] < LAYER_EXPERT_BYTES / 4, layout
