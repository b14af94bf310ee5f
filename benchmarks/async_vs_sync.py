"""Asynchronous (disaggregated, max_staleness) against synchronous training: step time, one sitting.

    python benchmarks/async_vs_sync.py                          # 20 steps per variant, 2 rounds
    python benchmarks/async_vs_sync.py --steps 30 --rounds 3 data.gen_batch_size=48

Runs the tiny run of examples/tiny_cpu.yaml (warm start from the cache, as `make run`
does; no evaluation, no checkpoints) once per variant per round, each in a fresh process,
the variants interleaved round by round so that load from other processes falls on all of
them alike:

    sync       colocated local engine (the default): generation and training take turns
    disagg-k0  the engine in its own process, max_staleness 0: still synchronous, the
               process boundary and the weight transfer are the only difference
    async-k1   the engine in its own process, max_staleness 1: the batch of step t+1 is
               generated while the actor trains step t; token TIS on, as recommended
               (it needs the full old-log-prob pass that the synchronous run halves)
    async-k2   max_staleness 2, token TIS

Prints per variant the median step time (timing_s/step over the steps after the first),
the actor's and the engine's median idle time per step, the median weight-transfer time
(timing_s/sync) and the ratio of the step time to the synchronous one.
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

TIS = ["algorithm.rollout_correction.rollout_is=token"]
"""The correction the asynchronous loop needs (DESIGN.md); it brings back the full old-log-prob pass."""

VARIANTS: dict[str, list[str]] = {
    "sync": [],
    "disagg-k0": ["rollout.placement=disaggregated", "trainer.max_staleness=0"],
    "async-k1": ["rollout.placement=disaggregated", "trainer.max_staleness=1", *TIS],
    "async-k2": ["rollout.placement=disaggregated", "trainer.max_staleness=2", *TIS],
}


def run_variant(config: str, steps: int, overrides: list[str], out_dir: Path) -> list[dict]:
    command = [sys.executable, "-m", "megatron_dapo.train", config, f"trainer.total_training_steps={steps}",
               "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_interval=0",
               "trainer.resume=disable", "logging.console=false", f"trainer.output_dir={out_dir}", *overrides]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, env={**os.environ})
    with (out_dir / "metrics.jsonl").open() as f:
        return [row for row in map(json.loads, f) if row["step"] > 0]


def median(rows: list[dict], key: str) -> float:
    values = [row.get(key, 0.0) for row in rows]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/tiny_cpu.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides for every variant")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    rows: dict[str, list[dict]] = {name: [] for name in names}
    walls: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                start = time.perf_counter()
                got = run_variant(args.config, args.steps, [*VARIANTS[name], *args.overrides],
                                  Path(tmp) / f"{name}-{r}")
                walls[name].append(time.perf_counter() - start)
                rows[name].extend(got[1:])  # the first step has nothing to overlap with
                print(f"round {r + 1} {name}: {walls[name][-1]:.1f} s", flush=True)
    base = median(rows["sync"], "timing_s/step") if "sync" in rows else None
    print(f"\n{args.steps} steps x {args.rounds} rounds per variant, medians over steps 2..{args.steps}; "
          f"{os.cpu_count()} CPUs")
    print("| variant | step s | actor idle s | engine idle s | weight transfer s | process wall s | step / sync |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        step = median(rows[name], "timing_s/step")
        ratio = f"{step / base:.2f}" if base else "-"
        print(f"| {name} | {step:.3f} | {median(rows[name], 'timing_s/actor_idle'):.3f} | "
              f"{median(rows[name], 'timing_s/engine_idle'):.3f} | {median(rows[name], 'timing_s/sync'):.3f} | "
              f"{statistics.median(walls[name]):.1f} | {ratio} |")


if __name__ == "__main__":
    main()
