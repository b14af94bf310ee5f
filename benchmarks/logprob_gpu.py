"""Log-probs + entropy from bf16 logits on one GPU: fused Triton kernel vs the chunked torch path.

    python benchmarks/logprob_gpu.py [--tokens 8192 --vocab 151936] [--json OUT.json]

Baselines measured in the same run: the HBM roofline (a device-to-device copy gives the
achievable bandwidth; forward must read the logits once, backward read them and write their
gradient), the naive `log_softmax(logits.float())` path (its extra memory is the 1.0x of the
memory column) and the chunked torch path of actor/logprobs.py. Correctness is checked
first, against float64 on a slice of rows: log-prob, entropy and the gradient of
sum(g_lp * log_prob + g_h * entropy). Needs CUDA and triton.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dapo.actor import triton_logprobs
from megatron_dapo.actor.logprobs import _ChunkedLogProbEntropy


def timed(fn, reps: int = 10) -> float:
    """Median milliseconds of fn() over reps runs after 3 warm-ups (CUDA events)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Achievable HBM bandwidth in bytes/s: a 4 GiB device-to-device copy, read + write counted."""
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))
    nbytes = 2 * src.numel() * src.element_size()

    return nbytes / (ms / 1e3)


def naive(logits, target, temperature):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, target[:, None]).squeeze(-1), entropy


def chunked(chunk):
    return lambda logits, target, t: _ChunkedLogProbEntropy.apply(logits, target, t, chunk, None, None)


def fused(logits, target, t):
    return triton_logprobs.triton_log_probs_and_entropy(logits, target, temperature=t)


def check(fn, logits, target, temperature, rows: int = 256) -> dict[str, float]:
    """Relative errors against float64 on `rows` random rows (fresh inputs every call)."""
    idx = torch.randperm(logits.shape[0], device=logits.device)[:rows]
    x = logits[idx].detach().clone().requires_grad_(True)
    t = target[idx]
    g_lp = torch.randn(rows, device=x.device)
    g_h = torch.randn(rows, device=x.device)
    lp, ent = fn(x, t, temperature)
    (g_lp * lp + g_h * ent).sum().backward()
    ref_x = x.detach().double().requires_grad_(True)
    logp = torch.log_softmax(ref_x / temperature, dim=-1)
    ref_lp = logp.gather(-1, t[:, None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (g_lp.double() * ref_lp + g_h.double() * ref_ent).sum().backward()

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    return {"log_prob": rel(lp, ref_lp), "entropy": rel(ent, ref_ent), "grad": rel(x.grad, ref_x.grad),
            "nan": bool(torch.isnan(lp).any() or torch.isnan(x.grad).any())}


def measure(name, fn, logits, target, temperature) -> dict[str, float]:
    """Forward and forward+backward times and the peak memory beyond logits + their gradient."""
    x = logits.detach().requires_grad_(True)
    g = torch.randn(logits.shape[0], device=logits.device)

    def fwd():
        with torch.no_grad():
            fn(x, target, temperature)

    def fwd_bwd():
        lp, ent = fn(x, target, temperature)
        torch.autograd.backward([lp, ent], [g, g])
        x.grad = None

    fwd_ms = timed(fwd)
    total_ms = timed(fwd_bwd)
    torch.cuda.synchronize()
    x.grad = torch.empty_like(x)  # the gradient buffer is not "extra": every path needs it
    base = torch.cuda.memory_allocated()
    x.grad = None
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    return {"name": name, "fwd_ms": fwd_ms, "bwd_ms": total_ms - fwd_ms, "extra_bytes": extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--json", default=os.environ.get("OUT", ".") + "/logprob_gpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    logits = (torch.randn(args.tokens, args.vocab, device="cuda") * 3).to(torch.bfloat16)
    target = torch.randint(0, args.vocab, (args.tokens,), device="cuda")
    nbytes = logits.numel() * logits.element_size()
    roof_fwd_ms = nbytes / bw * 1e3
    roof_bwd_ms = 2 * nbytes / bw * 1e3

    errors = {}
    for t in (1.0, 0.7):
        errors[f"triton T={t}"] = check(fused, logits, target, t)
        errors[f"chunked T={t}"] = check(chunked(1024), logits, target, t)
    for name, e in errors.items():
        print(f"check {name:<16} rel.err log_prob {e['log_prob']:.2e} entropy {e['entropy']:.2e} "
              f"grad {e['grad']:.2e} nan {e['nan']}")

    rows = [measure("naive fp32", naive, logits, target, args.temperature)]
    for chunk in (1024, 4096):
        rows.append(measure(f"chunked {chunk}", chunked(chunk), logits, target, args.temperature))
    variants = [(4096, 8), (8192, 8), (4096, 16), (8192, 16), (2048, 4)]
    for block, warps in variants:
        triton_logprobs.FORWARD_CONFIG.update(BLOCK=block, num_warps=warps)
        triton_logprobs.BACKWARD_CONFIG.update(BLOCK=block, num_warps=warps)
        rows.append(measure(f"triton {block}/{warps}", fused, logits, target, args.temperature))
    naive_extra = rows[0]["extra_bytes"]
    print(f"\nT={args.tokens} V={args.vocab} bf16 logits {nbytes / 2**30:.2f} GiB; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s (read+write); roofline fwd {roof_fwd_ms:.3f} ms, bwd {roof_bwd_ms:.3f} ms")
    print(f"{'path':<18}{'fwd ms':>9}{'roof/fwd':>10}{'bwd ms':>9}{'roof/bwd':>10}{'extra GiB':>11}{'x naive':>9}")
    for r in rows:
        r["fwd_roofline_ratio"] = roof_fwd_ms / r["fwd_ms"]
        r["bwd_roofline_ratio"] = roof_bwd_ms / r["bwd_ms"]
        r["extra_vs_naive"] = r["extra_bytes"] / naive_extra
        print(f"{r['name']:<18}{r['fwd_ms']:9.3f}{r['fwd_roofline_ratio']:10.2f}{r['bwd_ms']:9.3f}"
              f"{r['bwd_roofline_ratio']:10.2f}{r['extra_bytes'] / 2**30:11.3f}{r['extra_vs_naive']:9.3f}")
    Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bw": bw,
                                           "roofline_ms": [roof_fwd_ms, roof_bwd_ms], "errors": errors,
                                           "rows": rows, "tokens": args.tokens, "vocab": args.vocab}, indent=1))


if __name__ == "__main__":
    main()
