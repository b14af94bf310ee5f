"""The flagship rehearsed at its real shapes on one CPU machine (issue 28): conversion, parity, weight sync, planner.

    python benchmarks/scale.py                                   # Qwen2.5-32B shape, 2 layers (4.7 GiB)
    python benchmarks/scale.py --only convert parity             # a subset
    python benchmarks/scale.py --workdir /data/scale --keep      # keep the checkpoints
    python benchmarks/scale.py --model Qwen3-30B-A3B --only convert --convert-layout "--ep 8 --pp 2"
    python benchmarks/scale.py --model Qwen3-30B-A3B --only parity sync --parity-layout 1,1,8 --sync-layout 1,1,8

Rows (each with its bound; the script exits 1 if one is out of it):
- convert hf->mcore / mcore->hf: tools/convert_*.py exactly as the README writes them
  (`--tp 8 --pp 2`, one process), peak RSS from wait4() of the child, against issue 28's
  bound 0.75 x checkpoint + 1.5 GiB; the round trip compared tensor by tensor, bit for bit.
- parity: the actor's model at TP=8 (8 gloo processes, bf16, forward only; one KV head and
  19,008 of the 152,064 vocab rows per rank) against transformers on the same weights in
  bf16: largest |delta log p| of the next tokens <= 0.1 (tools/check_parity.py's bf16 bound).
- sync: the training loop's weight sync (export_hf -> sync_weights) from TP=8 x PP=2 (16
  processes) into a recording engine on the controller, at the model's real width: names,
  shapes, dtypes and bytes equal the HF checkpoint's; the embedding is larger than the bucket
  (it goes alone). The export sends every shard to the controller (receivers="controller",
  the path of an engine the controller feeds); only it holds a full tensor, so the rows are
  the controller's peak and the other ranks' (their parameters only). --sync-hidden runs the
  same shapes narrower; --receivers all gives every rank every tensor (colocated engines),
  which at the real width needs 16 x 1.5 GiB of transients: more than this machine has.
- planner: per-rank parameter bytes (plan/model.stage_params), the converter's peak and the
  export's per-rank peak (plan/host.py) against the measurements, within 5%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3


def _run(cmd: list[str], log: Path, **extra_env: str) -> tuple[float, int]:
    """Run a child with OMP_NUM_THREADS=1; (seconds, its peak RSS in bytes from wait4)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra_env)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024


def _torchrun(n: int) -> list[str]:
    from megatron_dapo.launcher import free_port

    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", f"--master-port={free_port()}"]


def _layout(text: str) -> dict[str, int]:
    """"TP,PP,EP" -> {"tp": .., "pp": .., "ep": ..}."""
    return dict(zip(("tp", "pp", "ep"), (int(v) for v in text.split(",")), strict=True))


def _shape(layout: dict[str, int]) -> str:
    return f"TP={layout['tp']} x PP={layout['pp']}" + (f" x EP={layout['ep']}" if layout["ep"] > 1 else "")


def _ranks(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("rank_*.json"))]


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, bool]] = []

    def add(self, what: str, measured: str, bound: str, ok: bool) -> None:
        self.rows.append((what, measured, bound, ok))
        print(f"  {'ok ' if ok else 'OUT'} {what}: {measured}  [{bound}]", flush=True)

    def near(self, what: str, predicted: float, measured: float, unit: float = GIB, name: str = "GiB") -> None:
        err = predicted / measured - 1
        self.add(what, f"predicted {predicted / unit:.3f} {name}, measured {measured / unit:.3f} {name} "
                 f"({err:+.1%})", "within 5%", abs(err) <= 0.05)


def _same_checkpoint(a: Path, b: Path) -> tuple[int, list[str]]:
    import torch

    from megatron_dapo.models.hf_checkpoint import HFCheckpoint

    ca, cb = HFCheckpoint(a, mapped=False), HFCheckpoint(b, mapped=False)
    if ca.shapes != cb.shapes or ca.dtypes != cb.dtypes:
        return len(ca.shapes), ["names, shapes or dtypes differ"]
    bad = [n for n in ca.shapes if not torch.equal(ca.read(n).view(-1).view(torch.uint8),
                                                   cb.read(n).view(-1).view(torch.uint8))]
    return len(ca.shapes), bad


def _shaped(out: Path, args: argparse.Namespace, log: Path, *extra: str) -> Path:
    if not (out / "model.safetensors.index.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        _run([sys.executable, "tools/make_shaped_checkpoint.py", "--model", args.model, "--layers", str(args.layers),
              "--out", str(out), *extra], log)
    return out


def convert(args: argparse.Namespace, work: Path, table: Table, hf: Path) -> None:
    from megatron_dapo.plan import host
    from megatron_dapo.plan.dims import ModelDims

    size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    bound = 0.75 * size + 1.5 * GIB
    mcore, back = work / "mcore", work / "hf_back"
    shutil.rmtree(mcore, ignore_errors=True)
    shutil.rmtree(back, ignore_errors=True)
    dims = ModelDims.from_hf(json.loads((hf / "config.json").read_text()), args.model, str(hf))
    layout = args.convert_layout.split()
    tp = int(layout[layout.index("--tp") + 1]) if "--tp" in layout else 1
    predicted, _ = host.converter_peak_bytes(dims, tp=tp)
    for label, cmd, log in (
        (f"convert hf->mcore {args.convert_layout}", ["tools/convert_hf_to_mcore.py", "--hf", str(hf), "--out",
                                                       str(mcore), *layout], "to_mcore.log"),
        ("convert mcore->hf", ["tools/convert_mcore_to_hf.py", "--ckpt", str(mcore), "--out", str(back),
                               "--max-shard-size", "4GB"], "to_hf.log"),
    ):
        seconds, peak = _run([sys.executable, *cmd], work / log)
        table.add(f"{label} peak RSS", f"{peak / GIB:.2f} GiB for {size / GIB:.2f} GiB ({peak / size:.2f}x), "
                  f"{seconds:.0f} s", f"<= 0.75x + 1.5 GiB = {bound / GIB:.2f} GiB", peak <= bound)
        table.near(f"planner: {label} peak", predicted, peak)
    count, bad = _same_checkpoint(hf, back)
    table.add("round trip HF -> mcore -> HF", f"{count} tensors, {len(bad)} differ {bad[:3]}", "bit-exact", not bad)
    if not args.keep:
        shutil.rmtree(mcore)
        shutil.rmtree(back)


def parity(args: argparse.Namespace, work: Path, table: Table, hf: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_dapo.plan.dims import ModelDims
    from megatron_dapo.plan.model import stage_params

    out = work / "parity"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    layout = _layout(args.parity_layout)
    shape = _shape(layout)
    seconds, _ = _run([*_torchrun(math.prod(layout.values())), "benchmarks/scale_ranks.py", "parity", "--hf", str(hf),
                       *(f"--{k}={v}" for k, v in layout.items()), "--out", str(out), "--tokens", str(args.tokens)],
                      work / "parity.log")
    ranks = _ranks(out)
    mine = torch.load(out / "megatron.pt")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.bfloat16)
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=mine["tokens"]).logits[0].float(), dim=-1)
    ref_seconds = time.perf_counter() - start
    del model
    tokens = mine["tokens"][0]
    ref_next = ref[:-1].gather(-1, tokens[1:].unsqueeze(-1)).squeeze(-1)
    diff = (ref_next - mine["next_log_probs"]).abs().max().item()
    kl = (ref.exp() * (ref - mine["log_probs"])).sum(-1).mean().item()
    table.add(f"parity {shape} bf16 vs transformers bf16", f"max |delta log p| {diff:.3e}, mean KL {kl:.2e} over "
              f"{tokens.numel() - 1} tokens (megatron {seconds:.0f} s, transformers {ref_seconds:.0f} s)",
              "<= 1e-1", diff <= 0.1)
    rows = {r["vocab_rows"] for r in ranks}
    config = json.loads((hf / "config.json").read_text())
    table.add(f"vocab rows per rank at TP={layout['tp']}",
              f"{sorted(rows)} (V {config['vocab_size']:,} padded to {layout['tp'] * min(rows):,})",
              f"V_pad / {layout['tp']}", len(rows) == 1)
    dims = ModelDims.from_hf(json.loads((hf / "config.json").read_text()), args.model, str(hf))
    from megatron_dapo.plan import host

    first = stage_params(dims, layout["tp"], layout["pp"], host.padded_vocab(dims, layout["tp"]), ep=layout["ep"])[0]
    predicted = (first.dense + first.experts) * 2
    measured = max(r["param_bytes"] for r in ranks if r["pp_rank"] == 0)
    table.near(f"planner: parameter bytes per rank at {shape}", predicted, measured)
    table.add("peak RSS per rank (parity)", f"max {max(r['peak_rss'] for r in ranks) / GIB:.2f} GiB over "
              f"{len(ranks)} ranks", "recorded", True)


def sync(args: argparse.Namespace, work: Path, table: Table, hf: Path | None) -> None:
    from megatron_dapo.models.hf_checkpoint import HFCheckpoint
    from megatron_dapo.plan import host
    from megatron_dapo.plan.dims import ModelDims

    if args.sync_hidden is not None:
        hf = _shaped(work / f"hf_h{args.sync_hidden}", args, work / "shaped_sync.log", "--set",
                     f"hidden_size={args.sync_hidden}", "--set", f"intermediate_size={args.sync_hidden * 27648 // 5120}")
    assert hf is not None
    out = work / "sync"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    # glibc keeps the freed mid-size gathered tensors (a few MB each: the qkv shards) in its heap
    # once its dynamic mmap threshold has risen, ~0.2 GiB on the controller here; the planner
    # counts live tensors, so the ranks run with the threshold fixed at 1 MiB, as the converters
    # set it for themselves (DESIGN.md, "Converters and glibc's mmap threshold"). --glibc-default
    # measures without.
    malloc = {} if args.glibc_default else {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    layout = _layout(args.sync_layout)
    seconds, _ = _run([*_torchrun(math.prod(layout.values())), "benchmarks/scale_ranks.py", "sync", "--hf", str(hf),
                       *(f"--{k}={v}" for k, v in layout.items()), "--out", str(out), "--bucket-mib",
                       str(args.bucket_mib), "--receivers", args.receivers], work / "sync.log", **malloc)
    shape = _shape(layout)
    ranks = _ranks(out)
    controller = ranks[0]
    ckpt = HFCheckpoint(hf, mapped=False)
    config = json.loads((hf / "config.json").read_text())
    same_names = sorted(controller["names"]) == sorted(ckpt.shapes) and len(set(controller["names"])) == len(ckpt.shapes)
    table.add(f"sync {shape} -> engine (hidden {config['hidden_size']:,}, V {config['vocab_size']:,}, "
              f"receivers {args.receivers}{', glibc default malloc' if args.glibc_default else ''})",
              f"{controller['num_tensors']} tensors, {controller['num_bytes'] / GIB:.3f} GiB, "
              f"{len(controller['mismatched'])} differ; largest bucket {controller['largest_bucket'] / 2**20:.0f} MiB "
              f"(bucket {args.bucket_mib} MiB); sync {controller['sync_seconds']:.0f} s, job {seconds:.0f} s",
              "names, shapes, bytes = checkpoint", same_names and not controller["mismatched"])
    dims = ModelDims.from_hf(config, args.model, str(hf))
    transient, _ = host.export_transient_bytes(dims, layout["tp"], pp=layout["pp"], ep=layout["ep"],
                                               receivers=args.receivers)
    others = [r for r in ranks if r["rank"] != 0]
    worst = max(others, key=lambda r: r["sync_peak_rss"] - r["rss_before_sync"])
    block = min(args.bucket_mib, 64) << 20  # the recording engine compares 64 MiB blocks
    # Resident at the sync's start (VmRSS) against the sync's own peak (VmHWM reset at its start).
    table.near("planner: sync peak of the controller (resident + export transient + block)",
               controller["rss_before_sync"] + transient + block, controller["sync_peak_rss"])
    # The other ranks only send their parameters (receivers=controller) or receive every tensor (all).
    extra = transient if args.receivers == "all" else 0
    table.near(f"planner: sync peak of rank {worst['rank']}, the highest of the other {len(others)} (resident"
               + (" + export transient)" if extra else ": no transient)"), worst["rss_before_sync"] + extra,
               worst["sync_peak_rss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen2.5-32B")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--only", nargs="+", choices=("convert", "parity", "sync"), default=["convert", "parity", "sync"])
    parser.add_argument("--convert-layout", default="--tp 8 --pp 2",
                        help="layout flags of the hf->mcore line (the README's; Qwen3-30B-A3B: '--ep 8 --pp 2')")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--sync-hidden", type=int, default=None, help="default: the model's own width")
    parser.add_argument("--receivers", choices=("all", "controller"), default="controller")
    parser.add_argument("--sync-layout", default="8,2,1", help="TP,PP,EP of the sync (Qwen3-30B-A3B: 1,1,8)")
    parser.add_argument("--parity-layout", default="8,1,1", help="TP,PP,EP of the parity ranks (Qwen3-30B-A3B: 1,1,8)")
    parser.add_argument("--glibc-default", action="store_true",
                        help="sync ranks keep glibc's dynamic mmap threshold (default: fixed at 1 MiB)")
    parser.add_argument("--bucket-mib", type=int, default=64)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="megatron-dapo-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {args.model} x {args.layers} layers, "
          f"work in {work}", flush=True)
    table = Table()
    hf = None
    if {"convert", "parity"} & set(args.only) or ("sync" in args.only and args.sync_hidden is None):
        hf = _shaped(work / "hf", args, work / "shaped.log")
        files = sorted(hf.glob("*.safetensors"))
        table.add("shaped checkpoint", f"{len(files)} shards, {sum(f.stat().st_size for f in files) / GIB:.2f} GiB bf16",
                  "hub-style", True)
    if "convert" in args.only:
        convert(args, work, table, hf)
    if "parity" in args.only:
        parity(args, work, table, hf)
    if "sync" in args.only:
        sync(args, work, table, hf)
    if not args.keep and args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    failed = [r for r in table.rows if not r[3]]
    print(f"{len(table.rows) - len(failed)} of {len(table.rows)} rows within their bounds")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
