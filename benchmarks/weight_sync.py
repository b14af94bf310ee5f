"""Bytes per second of a weight sync into the local engine vs a plain memory copy of the same bytes.

    python benchmarks/weight_sync.py                               # ~400 MB fp32 Qwen2-shaped model
    python benchmarks/weight_sync.py --bucket-mib 8 64 512 --hidden 1024 --layers 12

The model is a Qwen2-shaped LocalEngine built from a config only (no checkpoint on disk).
The "export" is a dict of fresh fp32 tensors with the engine's HF names and shapes, so the
sync measures what weight_sync.py and the engine add on top of moving the bytes: bucketing,
name/shape checks, the fan-out thread, finish_weight_update. Two baselines are measured in
the same process, on the same tensors:
- per-tensor copy: ``dst.copy_(src)`` for every tensor into preallocated destinations (the
  engine's own work without the sync machinery);
- flat copy: one ``copy_`` between two flat buffers of the total size (the memory bandwidth).
Each figure is the median of --repeats rounds after one warm-up; a round runs every variant
once, so load from other processes falls on all of them alike. ratio = sync GB/s / copy
GB/s (1.0 = the sync costs nothing beyond the copy), from wall time and from process CPU
time (all threads; steadier on a shared machine). One intra-op thread by default: on a
loaded 2-core machine, 2 OpenMP threads made the main thread's per-tensor copies 2-7x
slower from run to run (spinning workers under oversubscription), which measured the
machine, not the sync. The Megatron-side export (TP all-gather, PP
broadcast) is not included: it depends on the interconnect, not on this module.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import Qwen2Config

from megatron_dapo.rollout.local.engine import LocalEngine
from megatron_dapo.rollout.weight_sync import sync_weights


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds over all threads) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bucket-mib", type=int, nargs="+", default=[16, 64, 512], help="bucket sizes to try")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see the docstring)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=4,
        tie_word_embeddings=False,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        engine = LocalEngine(tmp, load_weights=False)
    targets = dict(engine.model.state_dict())
    export = {name: torch.randn_like(t) for name, t in targets.items()}
    total = sum(t.nbytes for t in export.values())
    print(f"model: {len(export)} tensors, {total / 2**20:.0f} MiB fp32, {args.threads} threads")

    def per_tensor_copy() -> None:
        for name, src in export.items():
            targets[name].copy_(src)

    flat_src = torch.empty(total, dtype=torch.uint8)
    flat_dst = torch.empty(total, dtype=torch.uint8)
    flat_src.fill_(1)
    last_stats = {}

    def sync(mib: int) -> None:
        last_stats[mib] = sync_weights(iter(export.items()), [engine], is_controller=True, bucket_bytes=mib << 20)

    variants = {f"sync{mib}": (lambda mib=mib: sync(mib)) for mib in args.bucket_mib}
    variants.update({"copy": per_tensor_copy, "flat": lambda: flat_dst.copy_(flat_src)})
    for fn in variants.values():
        fn()  # warm-up: first-touch page faults are not the steady state
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    # Rounds interleave the variants, so load from other processes hits all of them alike.
    for _ in range(args.repeats):
        for name, fn in variants.items():
            samples[name].append(_timed(fn))
    wall = {name: statistics.median(w for w, _ in runs) for name, runs in samples.items()}
    cpu = {name: statistics.median(c for _, c in runs) for name, runs in samples.items()}

    gb = total / 1e9
    print(f"per-tensor copy: {gb / wall['copy']:.2f} GB/s wall, {gb / cpu['copy']:.2f} GB/s CPU; "
          f"flat copy: {gb / wall['flat']:.2f} GB/s wall, {gb / cpu['flat']:.2f} GB/s CPU")  # fmt: skip
    print(f"{'bucket MiB':>10} {'buckets':>7} {'peak MiB':>8} {'sync s':>7} {'sync GB/s':>9} "
          f"{'sync/copy':>9} {'sync/flat':>9} {'cpu sync/copy':>13} {'cpu sync/flat':>13}")  # fmt: skip
    for mib in args.bucket_mib:
        stats, key = last_stats[mib], f"sync{mib}"
        assert stats.num_bytes == total
        print(f"{mib:>10} {stats.num_buckets:>7} {stats.peak_bucket_bytes / 2**20:>8.0f} {wall[key]:>7.3f} "
              f"{gb / wall[key]:>9.2f} {wall['copy'] / wall[key]:>9.2f} {wall['flat'] / wall[key]:>9.2f} "
              f"{cpu['copy'] / cpu[key]:>13.2f} {cpu['flat'] / cpu[key]:>13.2f}")  # fmt: skip
    for name, t in export.items():
        assert torch.equal(engine.model.state_dict()[name], t), name


if __name__ == "__main__":
    main()
