"""LoRA against full-parameter training on the tiny run: held-out gain, trainable fraction, step
time, peak memory and weight-sync bytes and seconds, the full run as the baseline of each seed.

    python benchmarks/lora_vs_full.py --seeds 301 302 303            # rank 16, alpha 32, lr 2e-3
    python benchmarks/lora_vs_full.py --seeds 301 --lora model.lora.rank=8 model.lora.alpha=16

Each seed runs `python -m megatron_dapo.train examples/tiny_cpu.yaml trainer.seed=S` twice, one
run at a time (the full run, then the LoRA run with --lora's overrides), under /usr/bin/time -v
for the peak RSS, and reads the runs' metrics.jsonl: val/acc at the first and last validation,
the median timing_s/step and timing_s/sync, and sync/num_bytes. The trainable fraction is the
planner's adapter count (plan/lora.py, held equal to the actor's by tests/unit/test_plan_lora.py)
over the model's parameters. Prints one row per seed and run, then the LoRA / full ratios.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

LORA = ("model.lora.rank=16", "model.lora.alpha=32", "optim.lr=2e-3")
"""The LoRA settings of docs/benchmarks.md's runs (chosen on the tuning seed 42, before seeds 301-303)."""


def _run(config: str, seed: int, out: Path, extra: list[str]) -> dict[str, float]:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "run.log"
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "megatron_dapo.train", config, f"trainer.seed={seed}",
           f"trainer.output_dir={out}", "trainer.resume=disable", "logging.console=false", *extra]
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}); see {log}")
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    val = [r["val/acc"] for r in rows if "val/acc" in r]
    return {"acc0": val[0], "acc": val[-1], "step_s": statistics.median(r["timing_s/step"] for r in rows
                                                                            if "timing_s/step" in r),
            "sync_s": statistics.median(r["timing_s/sync"] for r in rows if "timing_s/sync" in r),
            "sync_bytes": statistics.median(r["sync/num_bytes"] for r in rows if "sync/num_bytes" in r),
            "rss_gib": rss_kib / 2**20}


def _trainable_fraction(config: str, extra: list[str]) -> float:
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.plan import resolve_model
    from megatron_dapo.plan.lora import lora_params_per_gpu

    cfg = load_config(config, extra)
    dims = resolve_model(cfg)
    lora = cfg.model.lora
    return lora_params_per_gpu(dims, rank=lora.rank, targets=lora.targets, tp=1, pp=1, ep=1) / dims.num_params()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/tiny_cpu.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--out", type=Path, default=Path("/tmp/lora_vs_full"))
    parser.add_argument("--lora", nargs="*", default=list(LORA), help="the LoRA run's overrides")
    args = parser.parse_args()
    fraction = _trainable_fraction(args.config, args.lora)
    print(f"trainable parameters: full 1.000, LoRA {fraction:.4f} ({' '.join(args.lora)})")
    head = f"{'seed':>5} {'run':>5} {'acc0':>6} {'acc':>6} {'gain':>6} {'step_s':>7} {'sync_s':>7} " \
           f"{'sync_MB':>8} {'rss_GiB':>8}"
    print(head)
    ratios: dict[str, list[float]] = {"gain": [], "step_s": [], "sync_s": [], "sync_bytes": [], "rss_gib": []}
    for seed in args.seeds:
        runs = {name: _run(args.config, seed, args.out / f"{name}{seed}", extra)
                for name, extra in (("full", []), ("lora", args.lora))}
        for name, r in runs.items():
            print(f"{seed:>5} {name:>5} {r['acc0']:6.3f} {r['acc']:6.3f} {r['acc'] - r['acc0']:+6.3f} "
                  f"{r['step_s']:7.2f} {r['sync_s']:7.3f} {r['sync_bytes'] / 1e6:8.2f} {r['rss_gib']:8.2f}", flush=True)
        full, lora = runs["full"], runs["lora"]
        ratios["gain"].append((lora["acc"] - lora["acc0"]) / (full["acc"] - full["acc0"]))
        for key in ("step_s", "sync_s", "sync_bytes", "rss_gib"):
            ratios[key].append(lora[key] / full[key])
    print("LoRA / full (mean over seeds): " + ", ".join(f"{k} {statistics.mean(v):.3f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
