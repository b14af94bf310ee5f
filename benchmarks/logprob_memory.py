"""Peak memory and time of chunked vs naive log-prob + entropy, forward and backward, on CPU.

    python benchmarks/logprob_memory.py                      # T=4096, V=32768, fp32
    python benchmarks/logprob_memory.py --chunk-sizes 256 1024 --dtype bf16

Each variant runs in a fresh Python process, so one variant's freed-but-cached memory
cannot hide another's peak. In that process the logits [T, V] (and the small per-token
weights) are allocated first; the resident set size at that moment is the baseline, and
the variant's extra memory is the process' peak RSS (ru_maxrss) minus that baseline. It
includes the gradient of the logits, which every variant must produce. Large tensors are
mmap-backed allocations that go back to the OS when freed, so RSS tracks live tensors.

The naive variant is what a direct implementation does: log_softmax over the fp32 logits,
gather, entropy as -(p * log p).sum(), autograd backward. Time is the median of
`--repeats` runs after one warm-up run (the warm-up sets the memory peak), both as wall
time and as process CPU time (user + system, all threads): on a shared machine the CPU
time is the steadier of the two, since it does not count time spent waiting for a core.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _naive(logits: torch.Tensor, target: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)  # [T, V] fp32
    log_prob = log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_prob, entropy


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_variant(
    variant: str, num_tokens: int, vocab: int, dtype: str, chunk_size: int, repeats: int, num_threads: int
) -> dict:
    """Measure one variant in this process; returns peak extra bytes and timings."""
    from megatron_dapo.actor.logprobs import log_probs_and_entropy

    torch.set_num_threads(num_threads)
    gen = torch.Generator().manual_seed(0)
    # Filled a slice at a time: a whole fp32 randn would set a creation peak above the
    # baseline that ru_maxrss would then report as the variant's own.
    logits = torch.empty(num_tokens, vocab, dtype=_DTYPES[dtype])
    for start in range(0, num_tokens, 256):
        rows = logits[start:start + 256]
        rows.copy_(torch.randn(rows.shape, generator=gen).mul_(3))
    logits.requires_grad_(True)
    target = torch.randint(0, vocab, (num_tokens,), generator=gen)
    w_lp, w_h = torch.randn(num_tokens, generator=gen), torch.randn(num_tokens, generator=gen)

    def step() -> None:
        if variant == "naive":
            lp, h = _naive(logits, target, 1.0)
        else:
            lp, h = log_probs_and_entropy(logits, target, temperature=1.0, chunk_size=chunk_size)
        ((lp * w_lp).sum() + (h * w_h).sum()).backward()
        logits.grad = None

    baseline = _rss_bytes()
    wall, cpu = [], []
    for i in range(repeats + 1):
        start, start_cpu = time.perf_counter(), _cpu_seconds()
        step()
        if i > 0:
            wall.append(time.perf_counter() - start)
            cpu.append(_cpu_seconds() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"extra_bytes": peak - baseline, "wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
            "logits_bytes": logits.numel() * logits.element_size()}


def _spawn(variant: str, args: argparse.Namespace, chunk_size: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--tokens", str(args.tokens), "--vocab",
           str(args.vocab), "--dtype", args.dtype, "--chunk-size", str(chunk_size), "--repeats", str(args.repeats),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="T, tokens in the batch")
    parser.add_argument("--vocab", type=int, default=32768, help="V, vocabulary (slice) size")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="dtype of the logits")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[1024, 256], help="chunked variants to run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per variant")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--chunk-size", type=int, default=1024, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        print(json.dumps(run_variant(args.worker, args.tokens, args.vocab, args.dtype, args.chunk_size,
                                     args.repeats, args.threads)))
        return

    naive = _spawn("naive", args, 0)
    mib = 2**20
    print(f"log-prob + entropy, forward + backward, T={args.tokens} V={args.vocab} {args.dtype} logits "
          f"({naive['logits_bytes'] / mib:.0f} MiB), {args.threads} thread(s), CPU")
    print(f"{'variant':<18}{'extra MiB':>10}{'x naive':>9}{'cpu s':>8}{'x naive':>9}{'wall s':>8}{'x naive':>9}")

    def row(name: str, r: dict) -> str:
        return (f"{name:<18}{r['extra_bytes'] / mib:>10.0f}{r['extra_bytes'] / naive['extra_bytes']:>9.2f}"
                f"{r['cpu_s']:>8.2f}{r['cpu_s'] / naive['cpu_s']:>9.2f}"
                f"{r['wall_s']:>8.2f}{r['wall_s'] / naive['wall_s']:>9.2f}")

    print(row("naive", naive))
    for chunk_size in args.chunk_sizes:
        print(row(f"chunked c={chunk_size}", _spawn("chunked", args, chunk_size)))
    print("extra = peak RSS minus RSS after allocating the logits; includes the logits' gradient "
          f"({naive['logits_bytes'] / mib:.0f} MiB), which every variant produces")


if __name__ == "__main__":
    main()
