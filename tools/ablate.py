"""Learning evidence with a spread: the default run over seeds, and DAPO vs naive GRPO at an equal token budget.

    python tools/ablate.py --seeds 1,2,3                      # DAPO and GRPO, 3 seeds each
    python tools/ablate.py --seeds 1,2,3 --runs dapo          # the default run (make run) over 3 seeds
    python tools/ablate.py --seeds 1 --steps 10 [key=value]   # a quick look

Each seed is `trainer.seed=<s>` (scratch model, SFT draws, sampling) on examples/tiny_cpu.yaml
(DAPO) and examples/grpo_tiny_cpu.yaml (symmetric clip 0.2, seq-mean-token-mean, no dynamic
sampling, no overlong shaping). Every run of a seed shares its warm start (one cache entry).

Equal generated-token budget, not equal steps: dynamic sampling generates more per step
than GRPO does, so GRPO runs `--grpo-steps-factor` times DAPO's steps and its curve is cut
where its cumulative `train/num_generated_tokens` reaches the DAPO run's total; its
"last" accuracy is the last evaluation within that budget (the table says whether GRPO
reached the budget at all). Writes `<out>/ablation.md` (per-seed rows, then mean and
min/max per run kind) and `<out>/ablation.png`. Report what comes out, whatever it is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = {"dapo": ("DAPO", "examples/tiny_cpu.yaml"), "grpo": ("GRPO (naive)", "examples/grpo_tiny_cpu.yaml")}


def default_dapo_steps() -> int:
    """The default run's own step count (examples/tiny_cpu.yaml trainer.total_training_steps)."""
    import yaml

    return int(yaml.safe_load((REPO / RUNS["dapo"][1]).read_text())["trainer"]["total_training_steps"])


def run_one(config: str, out_dir: Path, seed: int, steps: int, overrides: list[str]) -> float:
    """Train one config into out_dir (fresh); returns wall seconds."""
    extra = [f"trainer.output_dir={out_dir}", "trainer.resume=disable", f"trainer.seed={seed}",
             f"trainer.total_training_steps={steps}", *overrides]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "megatron_dapo.train", str(REPO / config), *extra], cwd=REPO, check=True)
    return time.perf_counter() - start


def read_rows(out_dir: Path) -> list[dict]:
    with (out_dir / "metrics.jsonl").open() as f:
        return [json.loads(line) for line in f]


def generated_tokens(rows: list[dict]) -> float:
    return sum(r.get("train/num_generated_tokens", 0.0) for r in rows)


def cut_at_budget(rows: list[dict], budget: float | None) -> tuple[list[dict], bool]:
    """The rows up to the step where cumulative generated tokens reach `budget` (all if None).

    Returns:
        The rows kept, and whether the budget was reached.
    """
    if budget is None:
        return rows, True
    kept, total = [], 0.0
    for r in rows:
        total += r.get("train/num_generated_tokens", 0.0)
        kept.append(r)
        if total >= budget:
            return kept, True
    return kept, False


def summarize(rows: list[dict]) -> dict[str, float]:
    """First, last and best held-out accuracy, gain, and generated tokens of one run."""
    val = [r["val/acc"] for r in rows if r.get("val/acc") is not None]
    nan = float("nan")
    return {"val_first": val[0] if val else nan, "val_last": val[-1] if val else nan,
            "val_best": max(val) if val else nan, "gain_points": 100 * (val[-1] - val[0]) if val else nan,
            "steps": float(max((r["step"] for r in rows), default=0)), "gen_tokens": generated_tokens(rows)}


def aggregate(per_seed: list[dict[str, float]]) -> dict[str, tuple[float, float, float]]:
    """(mean, min, max) of every summary key over seeds."""
    return {k: (statistics.fmean(s[k] for s in per_seed), min(s[k] for s in per_seed), max(s[k] for s in per_seed))
            for k in per_seed[0]}


def write_table(results: dict[str, list[tuple[int, dict[str, float], float, bool]]], path: Path) -> str:
    lines = ["| run | seed | val acc first | last | best | gain (points) | RL steps | generated tokens | "
             "budget reached | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, seeds in results.items():
        for seed, s, wall, reached in seeds:
            lines.append(f"| {name} | {seed} | {s['val_first']:.3f} | {s['val_last']:.3f} | {s['val_best']:.3f} | "
                         f"{s['gain_points']:+.1f} | {s['steps']:.0f} | {s['gen_tokens']:.0f} | "
                         f"{'yes' if reached else 'no'} | {wall:.0f} |")
        agg = aggregate([s for _, s, _, _ in seeds])
        walls = [w for _, _, w, _ in seeds]

        def fmt(k: str, spec: str = ".3f", a: dict = agg) -> str:
            mean, low, high = a[k]
            return f"{mean:{spec}} [{low:{spec}}, {high:{spec}}]"

        lines.append(f"| **{name}: mean [min, max]** | {len(seeds)} seeds | {fmt('val_first')} | {fmt('val_last')} | "
                     f"{fmt('val_best')} | {fmt('gain_points', '+.1f')} | {fmt('steps', '.0f')} | "
                     f"{fmt('gen_tokens', '.0f')} | | {statistics.fmean(walls):.0f} [{min(walls):.0f}, {max(walls):.0f}] |")
    table = "\n".join(lines) + "\n"
    path.write_text(table)
    return table


def plot(curves: dict[str, list[list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for (name, runs), color in zip(curves.items(), ("C0", "C1")):
        for i, rows in enumerate(runs):
            tokens, acc, total = [], [], 0.0
            for r in rows:
                total += r.get("train/num_generated_tokens", 0.0)
                if r.get("val/acc") is not None:
                    tokens.append(total)
                    acc.append(r["val/acc"])
            ax.plot(tokens, acc, marker="o", color=color, alpha=0.8, label=name if i == 0 else None)
    ax.set(title="held-out accuracy (avg@4, T=1.0, top_p=0.7) per seed", xlabel="generated tokens", ylabel="acc")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "ablation", help="output directory")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[42],
                        help="comma-separated trainer.seed values, e.g. 1,2,3")
    parser.add_argument("--runs", default="dapo,grpo", help="which runs per seed: dapo, grpo or dapo,grpo")
    parser.add_argument("--steps", type=int, default=None,
                        help="RL steps of the DAPO run (default: the default run's trainer.total_training_steps)")
    parser.add_argument("--grpo-steps-factor", type=float, default=3.0,
                        help="GRPO runs this many times the DAPO steps, then is cut at DAPO's token budget")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = default_dapo_steps()
    kinds = args.runs.split(",")
    if any(k not in RUNS for k in kinds):
        parser.error(f"--runs {args.runs}: choose from {','.join(RUNS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[tuple[int, dict[str, float], float, bool]]] = {RUNS[k][0]: [] for k in kinds}
    curves: dict[str, list[list[dict]]] = {RUNS[k][0]: [] for k in kinds}
    for seed in args.seeds:
        budget = None
        for kind in kinds:
            name, config = RUNS[kind]
            steps = args.steps if kind == "dapo" or "dapo" not in kinds else round(args.steps * args.grpo_steps_factor)
            run_dir = args.out / f"{kind}_seed{seed}"
            wall = run_one(config, run_dir, seed, steps, args.overrides)
            rows, reached = cut_at_budget(read_rows(run_dir), budget)
            if kind == "dapo":
                budget = generated_tokens(rows)
            results[name].append((seed, summarize(rows), wall, reached))
            curves[name].append(rows)
            s = results[name][-1][1]
            print(f"{name} seed {seed}: val acc first {s['val_first']:.3f} last {s['val_last']:.3f} "
                  f"best {s['val_best']:.3f} ({s['gain_points']:+.1f} points), {wall:.0f} s", flush=True)
    print(write_table(results, args.out / "ablation.md"), end="")
    plot(curves, args.out / "ablation.png")
    print(f"wrote {args.out / 'ablation.md'} and {args.out / 'ablation.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
