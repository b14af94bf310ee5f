"""The multi-rank halves of benchmarks/scale.py, run under torchrun (gloo, CPU): one JSON per rank.

    torchrun --nproc-per-node 8 benchmarks/scale_ranks.py parity --hf DIR --tp 8 --out DIR
    torchrun --nproc-per-node 8 benchmarks/scale_ranks.py parity --hf DIR --tp 1 --ep 8 --out DIR  # Qwen3-30B-A3B
    torchrun --nproc-per-node 16 benchmarks/scale_ranks.py sync --hf DIR --tp 8 --pp 2 --out DIR
    torchrun --nproc-per-node 8 benchmarks/scale_ranks.py sync --hf DIR --tp 1 --ep 8 --out DIR   # Qwen3-30B-A3B

parity: each rank builds its shard of the actor's model in bf16 (forward only), loads the HF
checkpoint's slices, counts the parameter bytes it holds, and runs the same tokens; the last
stage's TP rank 0 saves the log-probs of the next tokens (scale.py compares them with
transformers in a process of its own, so the two models never share memory).
sync: the weight sync of the training loop (export_hf -> sync_weights, bounded buckets) into
a recording engine on the controller that checks each tensor's name, shape, dtype and bytes
against the HF checkpoint as it arrives and keeps nothing. Every rank reports its peak RSS.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time
from pathlib import Path

import torch

_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak since start or the last reset) from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak_rss() -> None:
    """Linux resets VmHWM to the current RSS (clear_refs value 5): the sync's own peak, not the load's."""
    Path("/proc/self/clear_refs").write_text("5")


class RecordingEngine:
    """Takes weight buckets like an engine and compares each tensor with the checkpoint, keeping none.

    The comparison reads the stored tensor a block of rows at a time (at most 64 MiB), so
    checking the 1.5 GiB embedding adds one block, not a second embedding, to the peak.
    """

    BLOCK_BYTES = 64 << 20

    def __init__(self, hf_dir: str) -> None:
        from megatron_dapo.models.hf_checkpoint import HFCheckpoint

        self.ckpt = HFCheckpoint(hf_dir, mapped=False)
        self.seen: list[str] = []
        self.mismatched: list[str] = []
        self.largest_bucket = 0

    def update_weights(self, bucket: list) -> None:
        self.largest_bucket = max(self.largest_bucket, sum(t.numel() * t.element_size() for _, t in bucket))
        for name, tensor in bucket:
            self.seen.append(name)
            if not self._same(name, tensor):
                self.mismatched.append(name)

    def _same(self, name: str, tensor: torch.Tensor) -> bool:
        if self.ckpt.shapes[name] != tuple(tensor.shape) or self.ckpt.dtypes[name] != _SAFETENSORS_DTYPE[tensor.dtype]:
            return False
        rows = tensor.shape[0] if tensor.dim() else 1
        row_bytes = tensor.numel() * tensor.element_size() // max(rows, 1)
        step = max(1, self.BLOCK_BYTES // max(row_bytes, 1))
        for start in range(0, rows, step):
            stored = self.ckpt.read(name, 0, start, min(start + step, rows))
            mine = tensor[start:start + step] if tensor.dim() else tensor
            same = torch.equal(stored.reshape(-1).view(torch.uint8), mine.contiguous().reshape(-1).view(torch.uint8))
            del stored  # before the next block is read: one block held, not two
            if not same:
                return False
        return True

    def finish_weight_update(self, version: int | None = None) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("parity", "sync"))
    parser.add_argument("--hf", required=True)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--out", required=True, help="directory for rank_<r>.json (and the log-probs)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--receivers", choices=("all", "controller"), default="controller",
                        help="export_hf's receivers: the controller alone (a server it feeds) or every rank (colocated)")
    args = parser.parse_args()

    import torch.distributed as dist

    from megatron_dapo import parallel
    from megatron_dapo.models import adapter_for
    from megatron_dapo.models.parity import full_vocab_log_probs
    from megatron_dapo.rollout.weight_sync import sync_weights

    adapter = adapter_for(args.hf)
    parallel.init_distributed("cpu")
    dims = parallel.initialize_model_parallel(args.tp, args.pp, ep=args.ep,
                                              num_experts=adapter.hf.num_experts if adapter.hf.is_moe else None,
                                              num_attention_heads=adapter.hf.num_attention_heads,
                                              num_query_groups=adapter.hf.num_kv_heads,
                                              num_layers=adapter.hf.num_layers)
    start = time.perf_counter()
    model = adapter.build_model(dims, dtype=torch.bfloat16, init_weights=False)
    adapter.load_hf(model, args.hf, dims)
    model.eval()
    report: dict = {"rank": dims.rank, "tp_rank": dims.tp_rank, "pp_rank": dims.pp_rank,
                    "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                    "vocab_rows": adapter.padded_vocab_size(dims.tp) // dims.tp,
                    "load_seconds": time.perf_counter() - start, "rss_after_load": _rss()}
    out = Path(args.out)
    if args.what == "parity":
        tokens = torch.randint(0, adapter.hf.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        log_probs = full_vocab_log_probs(model, dims, tokens, adapter.hf.vocab_size)
        report["forward_seconds"] = time.perf_counter() - start
        if log_probs is not None and dims.tp_rank == 0 and dims.dp_rank == 0 and dims.cp_rank == 0:  # one writer
            next_lp = log_probs[0, :-1].gather(-1, tokens[0, 1:].unsqueeze(-1)).squeeze(-1)
            torch.save({"tokens": tokens, "next_log_probs": next_lp, "log_probs": log_probs[0]}, out / "megatron.pt")
    else:
        engine = RecordingEngine(args.hf) if dims.is_controller else None
        gc.collect()
        resident = _status_bytes("VmRSS")
        _reset_peak_rss()
        stats = sync_weights(adapter.export_hf(model, dims, receivers=args.receivers), [engine] if engine else [],
                             is_controller=dims.is_controller, bucket_bytes=args.bucket_mib << 20)
        report.update(rss_before_sync=resident, sync_peak_rss=_status_bytes("VmHWM"), sync_seconds=stats.seconds, peak_bucket_bytes=stats.peak_bucket_bytes)
        if engine is not None:
            report.update(num_tensors=len(engine.seen), mismatched=engine.mismatched, names=engine.seen,
                          largest_bucket=engine.largest_bucket, num_bytes=stats.num_bytes)
    report["peak_rss"] = _rss()
    (out / f"rank_{dims.rank:02d}.json").write_text(json.dumps(report))
    dist.barrier()
    parallel.destroy()


if __name__ == "__main__":
    main()
