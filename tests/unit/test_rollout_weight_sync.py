"""Bucketing and fan-out of the weight sync, on synthetic tensors and into the local engine."""

from collections.abc import Iterator, Sequence

import pytest
import torch
from model_utils import make_tiny_checkpoint

from megatron_dapo.rollout.local.engine import LocalEngine
from megatron_dapo.rollout.weight_sync import BucketMeter, iter_buckets, sync_weights


def _tensors(sizes: Sequence[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Lazily made uint8 tensors of the given byte sizes, named t0, t1, ..."""
    for i, size in enumerate(sizes):
        yield f"t{i}", torch.full((size,), i, dtype=torch.uint8)


class RecordingEngine:
    """Receives buckets like an engine and records exactly what arrived."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.buckets: list[list[str]] = []
        self.finished = 0

    def update_weights(self, bucket):
        self.buckets.append([n for n, _ in bucket])

    def finish_weight_update(self, version=None):
        self.finished += 1


def test_bucket_closes_when_next_tensor_would_exceed_budget():
    sizes = [100, 200, 300, 50, 600, 10, 390]
    meter = BucketMeter()
    buckets = [[n for n, _ in b] for b in iter_buckets(_tensors(sizes), 400, meter)]
    assert buckets == [["t0", "t1"], ["t2", "t3"], ["t4"], ["t5", "t6"]]
    # Held at most: a bucket under budget plus the tensor that did not fit (350 + 600).
    assert meter.peak_bytes == 950
    with pytest.raises(ValueError, match="bucket_bytes=0 must be > 0"):
        list(iter_buckets(_tensors([1]), 0))


def test_sync_fans_every_bucket_out_to_every_engine_and_reports_stats():
    engines = [RecordingEngine("a"), RecordingEngine("b")]
    sizes = [256] * 40
    stats = sync_weights(_tensors(sizes), engines, is_controller=True, bucket_bytes=1024)
    expected = [[f"t{i}" for i in range(k, k + 4)] for k in range(0, 40, 4)]
    assert engines[0].buckets == engines[1].buckets == expected
    assert [e.finished for e in engines] == [1, 1]
    assert (stats.num_bytes, stats.num_tensors, stats.num_buckets) == (10240, 40, 10)
    assert stats.peak_bucket_bytes == 1024
    assert stats.seconds > 0


def test_non_controller_consumes_the_export_and_sends_nothing():
    consumed = []

    def export():
        for name, t in _tensors([8, 8, 8]):
            consumed.append(name)  # a collective gather would run here on every rank
            yield name, t

    engine = RecordingEngine("a")
    stats = sync_weights(export(), [engine], is_controller=False, bucket_bytes=16)
    assert consumed == ["t0", "t1", "t2"]
    assert engine.buckets == [] and engine.finished == 0
    assert (stats.num_bytes, stats.num_tensors, stats.num_buckets, stats.peak_bucket_bytes) == (0, 0, 0, 0)
    with pytest.raises(ValueError, match="got no engines"):
        sync_weights(_tensors([1]), [], is_controller=True)


def test_sync_into_local_engine_is_bit_exact(tmp_path):
    source = LocalEngine(make_tiny_checkpoint(tmp_path / "a", num_layers=2, tie_word_embeddings=True, seed=1)).model
    engine = LocalEngine(make_tiny_checkpoint(tmp_path / "b", num_layers=2, tie_word_embeddings=True, seed=2))
    # An HF export omits the tied lm_head, as the checkpoint does.
    export = ((n, t.clone()) for n, t in source.state_dict().items() if n != "lm_head.weight")
    stats = sync_weights(export, [engine], is_controller=True, bucket_bytes=8 * 1024)
    received = engine.model.state_dict()
    assert received.keys() == source.state_dict().keys()
    for name, tensor in source.state_dict().items():
        assert torch.equal(received[name], tensor), name
    assert stats.num_tensors == len(source.state_dict()) - 1
    assert stats.num_buckets > 3
    assert stats.peak_bucket_bytes <= 8 * 1024 + max(t.nbytes for t in source.state_dict().values())
