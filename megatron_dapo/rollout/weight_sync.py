"""Step 7 of the RL step: stream the trainer's weights to the rollout engines in bounded buckets.

The model adapter's ``export_hf(model)`` is a collective generator: every rank iterates it
in lockstep while it gathers tensor-parallel shards and pipeline stages, one full HF-named
tensor at a time. :func:`sync_weights` runs on every rank so those collectives match, but
only the controller (global rank 0) keeps what it yields: it packs tensors into buckets
of at most ``bucket_bytes`` and hands each finished bucket to every engine before taking
the next tensor. The controller therefore holds about one bucket of gathered tensors, never
the whole model, which is what lets a 32B model (65 GB in bf16) sync next to a live
optimizer. A single tensor larger than the budget travels alone in its own bucket.

After the last bucket each engine's ``finish_weight_update`` drops caches computed with
the old weights (SGLang's radix cache).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from megatron_dapo.rollout.engine import RolloutEngine

__all__ = ["DEFAULT_BUCKET_BYTES", "BucketMeter", "WeightSyncStats", "iter_buckets", "sync_weights", "with_lm_head_copy"]

DEFAULT_BUCKET_BYTES = 512 * 1024**2


@dataclass(kw_only=True, slots=True)
class WeightSyncStats:
    """What one weight sync moved (zeros on ranks other than the controller)."""

    num_bytes: int
    """Bytes of tensor data sent to each engine."""
    num_tensors: int
    """Tensors sent to each engine."""
    num_buckets: int
    """Buckets sent to each engine."""
    seconds: float
    """Wall time of the sync on this rank, export included."""
    peak_bucket_bytes: int
    """Most tensor bytes the bucketer held at once; SGLang's flattened format (flat_bucket.py)
    copies a bucket once more while it is sent, so that sync's extra memory is up to twice this."""


class BucketMeter:
    """Counts what the bucketer holds; the peak is the sync's extra memory."""

    def __init__(self) -> None:
        self.peak_bytes = 0


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, meter: BucketMeter | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into buckets of at most ``bucket_bytes`` each.

    A bucket is closed when adding the next tensor would exceed the budget, or as soon as
    it reaches the budget, so at most ``bucket_bytes`` plus one tensor are held at once.

    Args:
        named_tensors: (hf_name, full tensor) pairs, consumed lazily.
        bucket_bytes: budget per bucket (> 0); a larger tensor forms a bucket of its own.
        meter: records the peak of bytes held, the incoming tensor included.

    Returns:
        An iterator of non-empty buckets in input order.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0 (rollout.update_weights_bucket_megabytes)")
    bucket: list[tuple[str, torch.Tensor]] = []
    held = 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if meter is not None:
            meter.peak_bytes = max(meter.peak_bytes, held + size)
        if bucket and held + size > bucket_bytes:
            yield bucket
            bucket, held = [], 0
        bucket.append((name, tensor))
        held += size
        if held >= bucket_bytes:
            # Full (or one oversized tensor): send now rather than hold it while the next one is made.
            yield bucket
            bucket, held = [], 0
    if bucket:
        yield bucket


def sync_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    engines: Sequence[RolloutEngine],
    *,
    is_controller: bool,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    version: int | None = None,
) -> WeightSyncStats:
    """Stream the exported weights to every engine; call on every rank.

    Args:
        named_tensors: the adapter's export_hf(model) generator (collective: every rank
            must consume it fully, which this function does).
        engines: engines to update; only used on the controller.
        is_controller: True on global rank 0, the only rank that sends.
        bucket_bytes: budget per bucket in bytes (default 512 MiB).
        version: the weights' version (the trainer step that made them), for engines that tag
            their results with it.

    Returns:
        Bytes, tensors and buckets sent per engine, seconds, and the bucketer's peak bytes.
    """
    start = time.perf_counter()
    if not is_controller:
        for _ in named_tensors:
            pass  # keep the export's collectives in lockstep with the controller
        return WeightSyncStats(num_bytes=0, num_tensors=0, num_buckets=0, seconds=time.perf_counter() - start,
                               peak_bucket_bytes=0)
    if not engines:
        raise ValueError("sync_weights on the controller got no engines; pass the rollout engines to update")
    meter = BucketMeter()
    num_bytes = num_tensors = num_buckets = 0
    with ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="weight-sync") as pool:
        for bucket in iter_buckets(named_tensors, bucket_bytes, meter):
            # Engines load the same bucket concurrently; the next bucket waits for all of them,
            # which bounds the memory held to one bucket.
            for future in [pool.submit(engine.update_weights, bucket) for engine in engines]:
                future.result()
            num_buckets += 1
            num_tensors += len(bucket)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            # The loop variable would keep the sent tensors alive while the export gathers the
            # next bucket: two buckets held, not one (measured by tests/multirank/test_weight_sync_moe.py).
            del bucket
        for future in [pool.submit(engine.finish_weight_update, version=version) for engine in engines]:
            future.result()
    return WeightSyncStats(
        num_bytes=num_bytes,
        num_tensors=num_tensors,
        num_buckets=num_buckets,
        seconds=time.perf_counter() - start,
        peak_bucket_bytes=meter.peak_bytes,
    )


LM_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def with_lm_head_copy(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, with the embedding also as ``lm_head.weight`` (an engine that needs it says so:
    ``lm_head_copy``, sglang/server.copies_lm_head).

    Args:
        named: (HF name, tensor) of a tied model's export (no lm_head.weight of its own); a list
            that already holds lm_head.weight passes unchanged.
    """
    named = list(named) if isinstance(named, list | tuple) else named
    has_head = isinstance(named, list) and any(name == LM_HEAD for name, _ in named)
    for name, tensor in named:
        yield name, tensor
        if name == EMBEDDING and not has_head:
            yield LM_HEAD, tensor
