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

    python benchmarks/async_vs_sync.py --variants none --fleets sglang:1,sglang:2,vllm:1,vllm:2

`--fleets ENGINE:N,...` adds, per fleet (issue 41: N servers of rollout.engine beside the
trainer, weights by broadcast), `ENGINE:N-k0` (max_staleness 0: generation and update take
turns, so each is measured alone) and `ENGINE:N-k1` (max_staleness 1, token TIS), and a second
table: the k1 step against the pipelining limit from the k0 run of the same round, the median
over its steps of max(generation alone, update alone) (generation: timing_s/collect, the batch
with its rewards; update: the rest of the step, weight broadcast included). Issue 41's goal is
<= 1.15x. On a 2-core CPU the servers and the actor share the cores, so the limit (each phase
with the machine to itself) cannot be reached there; the ratio says how far contention leaves it.
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


def fleet_variants(spec: str) -> dict[str, list[str]]:
    """`sglang:1,vllm:2` -> {"sglang:1-k0": [...], "sglang:1-k1": [...], ...}."""
    variants: dict[str, list[str]] = {}
    for item in filter(None, spec.split(",")):
        engine, _, count = item.partition(":")
        if engine not in ("sglang", "vllm") or not count.isdigit() or int(count) < 1:
            raise SystemExit(f"--fleets: {item!r} is not ENGINE:N with ENGINE sglang or vllm and N >= 1, e.g. vllm:2")
        fleet = ["rollout.placement=disaggregated", f"rollout.engine={engine}", f"rollout.num_engines={count}"]
        # TIS in both: the same actor work per step (its full old-log-prob pass), only the overlap differs.
        variants[f"{item}-k0"] = [*fleet, "trainer.max_staleness=0", *TIS]
        variants[f"{item}-k1"] = [*fleet, "trainer.max_staleness=1", *TIS]
    return variants


def pipelining_limit(k0_rows: list[dict]) -> float:
    """Median over steps of max(generation alone, update alone) in a max_staleness 0 run."""
    limits = [max(r.get("timing_s/collect", 0.0), r["timing_s/step"] - r.get("timing_s/collect", 0.0))
              for r in k0_rows]
    return statistics.median(limits) if limits else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/tiny_cpu.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {list(VARIANTS)}, or none")
    parser.add_argument("--fleets", default="", help="ENGINE:N,... fleets to add (k0 and k1 each), e.g. sglang:2,vllm:2")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides for every variant")
    args = parser.parse_args()
    names = [] if args.variants == "none" else args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    fleets = fleet_variants(args.fleets)
    variants = {**VARIANTS, **fleets}
    names += list(fleets)
    if not names:
        parser.error("nothing to run: --variants none and no --fleets")
    limits: dict[str, list[float]] = {name: [] for name in fleets if name.endswith("-k0")}
    rows: dict[str, list[dict]] = {name: [] for name in names}
    walls: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                start = time.perf_counter()
                got = run_variant(args.config, args.steps, [*variants[name], *args.overrides],
                                  Path(tmp) / f"{name.replace(':', '')}-{r}")
                walls[name].append(time.perf_counter() - start)
                rows[name].extend(got[1:])  # the first step has nothing to overlap with
                if name in limits:
                    limits[name].append(pipelining_limit(got[1:]))
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
    if limits:
        print("\n| fleet | k1 step s | generation alone s | update alone s | limit max(gen, update) s | "
              "k1 step / limit (goal <= 1.15) |")
        print("|---|---|---|---|---|---|")
        for k0 in limits:
            fleet, k1 = k0.removesuffix("-k0"), k0.replace("-k0", "-k1")
            step, limit = median(rows[k1], "timing_s/step"), statistics.median(limits[k0])
            gen = median(rows[k0], "timing_s/collect")
            update = statistics.median([r["timing_s/step"] - r.get("timing_s/collect", 0.0) for r in rows[k0]])
            print(f"| {fleet} | {step:.3f} | {gen:.3f} | {update:.3f} | {limit:.3f} | {step / limit:.2f} |")


if __name__ == "__main__":
    main()
