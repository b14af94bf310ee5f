"""Learning evidence with a spread: the default run over seeds, DAPO vs naive GRPO at an equal
token budget, and DAPO with one component removed at a time.

    python tools/ablate.py --seeds 1001,1002,1003                    # DAPO and GRPO per seed
    python tools/ablate.py --seeds 1,2,3 --runs dapo                 # the default run (make run) over seeds
    python tools/ablate.py --seeds 1,2 --runs dapo,no-clip-higher,token-mean-off,no-dynamic-sampling,no-overlong
    python tools/ablate.py --seeds 1 --steps 10 [key=value]          # a quick look
    python tools/ablate.py --seeds 1,2,3,4 --jobs 2                  # two seeds at a time, one thread each
    python tools/ablate.py --seeds 21,22,23 --runs dapo,sglang-fleet,vllm-fleet --equal steps --steps 40
                                                                     # issue 41: fleets against colocated

Each seed is `trainer.seed=<s>` (scratch model, SFT draws, sampling) on examples/tiny_cpu.yaml
(DAPO) and examples/grpo_tiny_cpu.yaml (symmetric clip 0.2, seq-mean-token-mean, no dynamic
sampling, no overlong shaping). The component runs are DAPO with exactly one change (RUNS).
Every run of a seed shares its warm start (one cache entry).

Equal generated-token budget, not equal steps: dynamic sampling generates more per step
than GRPO does, so every other run may take up to `--steps-factor` times DAPO's steps; it is
stopped once its cumulative `train/num_generated_tokens` reaches the DAPO run's total and
its curve is cut there; its "last" accuracy is the last evaluation within that budget (the
table says whether it reached the budget at all).

Against DAPO, per seed: the lead (DAPO's last held-out accuracy minus the other run's, in
points; the same seed starts both from the same warm start), then over seeds its mean, a
95% confidence interval (paired Student t) and the two-sided sign test. "Significant" means
the interval excludes 0. Writes `<out>/ablation.md` and `<out>/ablation.png` (each seed
against generated tokens and against RL steps).

`--equal steps` compares per RL step instead: every other run trains exactly DAPO's steps
(no token budget) into `<kind>_seed<s>_steps`. Cutting the token-budget runs at DAPO's step
count would not do: their lr decays over their own up-to-3x steps, so at DAPO's last step
they are mid-schedule (on the evaluation seeds that cut read DAPO +10.4 points, the runs
with their own 160-step decay +4.9; docs/benchmarks.md). Report what comes out, whatever it is.

`--jobs N` runs N seeds at once with `OMP_NUM_THREADS = cores // N` each. The thread count
changes float summation order: equal over 20 steps, but a whole run (its SFT warm start
included) can land elsewhere (docs/benchmarks.md), so compare runs made with the same --jobs.
A run that already ended in `--out` with the same command is reused (`ablate.json` in its
directory): a killed sweep resumes, and DAPO runs timed alone (`--runs dapo --jobs 1`) pair
later with the other runs made two at a time (`--runs dapo,grpo --jobs 2`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DAPO_CONFIG = "examples/tiny_cpu.yaml"


@dataclass(frozen=True)
class RunKind:
    """One arm of the ablation."""

    label: str
    config: str
    overrides: tuple[str, ...] = ()


FLEET = ("rollout.placement=disaggregated", "rollout.num_engines=2", "trainer.max_staleness=1",
         "algorithm.rollout_correction.rollout_is=token")

RUNS: dict[str, RunKind] = {
    "dapo": RunKind("DAPO", DAPO_CONFIG),
    "grpo": RunKind("GRPO (naive)", "examples/grpo_tiny_cpu.yaml"),
    # DAPO with one component taken out, the rest as in the default run.
    "no-clip-higher": RunKind("DAPO - Clip-Higher", DAPO_CONFIG, ("algorithm.clip_ratio_high=0.2",)),
    "token-mean-off": RunKind("DAPO - token-mean", DAPO_CONFIG, ("algorithm.loss_agg_mode=seq-mean-token-mean",)),
    "no-dynamic-sampling": RunKind("DAPO - dynamic sampling", DAPO_CONFIG,
                                   ("algorithm.filter_groups.enable=false", "data.gen_batch_size={train_batch_size}")),
    "no-overlong": RunKind("DAPO - overlong shaping", DAPO_CONFIG, ("reward.overlong_buffer.enable=false",)),
    # Issue 41's fleets: the default run on two servers beside the trainer, one step off-policy
    # (weights by broadcast after each update, generation of step t+1 overlapping it), token TIS.
    # Compared with the default (colocated) run per RL step: --equal steps.
    "sglang-fleet": RunKind("DAPO on 2 SGLang servers, async", DAPO_CONFIG, (*FLEET, "rollout.engine=sglang")),
    "vllm-fleet": RunKind("DAPO on 2 vLLM servers, async", DAPO_CONFIG, (*FLEET, "rollout.engine=vllm")),
}

# Two-sided 95% quantiles of Student's t, df 1..30 (beyond: the normal 1.96 is within 2%).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def dapo_setting(section: str, key: str) -> int:
    """One integer setting of the default run (examples/tiny_cpu.yaml)."""
    import yaml

    return int(yaml.safe_load((REPO / DAPO_CONFIG).read_text())[section][key])


def default_dapo_steps() -> int:
    """The default run's own step count (examples/tiny_cpu.yaml trainer.total_training_steps)."""
    return dapo_setting("trainer", "total_training_steps")


def read_rows(out_dir: Path) -> list[dict]:
    """metrics.jsonl of a run, skipping a torn last line (a run stopped at its budget)."""
    rows = []
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def generated_tokens(rows: list[dict]) -> float:
    return sum(r.get("train/num_generated_tokens", 0.0) for r in rows)


EQUAL = {"tokens": ("generated tokens", ""), "steps": ("RL steps", "_steps")}
"""--equal -> (the axis the lead is read at, the suffix of the other runs' directories and the table)."""

DONE = "ablate.json"
"""Written into a run's directory when it ends: what it ran, and its wall time."""


def run_one(kind: RunKind, out_dir: Path, seed: int, steps: int, overrides: list[str], *,
            budget: float | None = None, threads: int | None = None) -> float:
    """Train one run into out_dir (fresh), stopping it once it has generated `budget` tokens.

    A run that already ended in out_dir with the same command and budget (its `ablate.json`)
    is not run again: its wall time is the one recorded, so a killed sweep resumes where it
    stopped, and runs timed alone (--jobs 1) can be paired later with runs made two at a time.

    Returns:
        Wall seconds.
    """
    batch = [o.split("=", 1)[1] for o in overrides if o.startswith("data.train_batch_size=")]
    fields = {"train_batch_size": batch[-1] if batch else dapo_setting("data", "train_batch_size")}
    extra = [f"trainer.output_dir={out_dir}", "trainer.resume=disable", f"trainer.seed={seed}",
             f"trainer.total_training_steps={steps}", *(o.format(**fields) for o in kind.overrides), *overrides]
    record = {"config": kind.config, "overrides": extra, "budget": budget}
    done = out_dir / DONE
    if done.is_file():
        previous = json.loads(done.read_text())
        if {k: previous.get(k) for k in record} == record:
            return float(previous["wall_s"])
        done.unlink()
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with (out_dir / "ablate.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_dapo.train", str(REPO / kind.config), *extra],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(2.0)
            if budget is not None and generated_tokens(read_rows(out_dir)) >= budget:
                proc.terminate()
                proc.wait()
                break
    if proc.returncode != 0 and not (budget is not None and generated_tokens(read_rows(out_dir)) >= budget):
        raise SystemExit(f"{kind.label} seed {seed} failed (exit {proc.returncode}); see {out_dir / 'ablate.log'}")
    wall = time.perf_counter() - start
    done.write_text(json.dumps({**record, "wall_s": wall, "threads": env.get("OMP_NUM_THREADS")}) + "\n")
    return wall


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


def paired_lead(leads: list[float]) -> dict[str, float]:
    """Mean of paired differences, its 95% Student-t interval and the two-sided sign-test p-value.

    Args:
        leads: per-seed differences (points); ties (0) count for neither side in the sign test.
    """
    n = len(leads)
    mean = statistics.fmean(leads)
    half = float("nan")
    if n >= 2:
        t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
        half = t * statistics.stdev(leads) / math.sqrt(n)
    wins, losses = sum(d > 0 for d in leads), sum(d < 0 for d in leads)
    m = wins + losses
    tail = sum(math.comb(m, k) for k in range(min(wins, losses) + 1)) / 2**m if m else 1.0
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half, "wins": wins, "losses": losses,
            "sign_p": min(1.0, 2 * tail)}


def write_table(results: dict[str, list[tuple[int, dict[str, float], float, bool]]], path: Path,
                axis: str = "generated tokens") -> str:
    """Per-seed rows and mean [min, max] per run, then each run's paired lead against the first run
    (at equal `axis`: what the runs were matched on)."""
    lines = ["| run | seed | held-out avg@4 first | last | best | gain (points) | RL steps | generated tokens | "
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
    names = list(results)
    if len(names) > 1:
        base = names[0]
        lines += ["", f"| {base} minus | at equal | seeds | lead, mean (points) | 95% CI (paired t) | "
                  f"{base} ahead / behind | sign test p | significant |", "|---|---|---|---|---|---|---|---|"]
        for other in names[1:]:
            theirs = {seed: s["val_last"] for seed, s, _, _ in results[other]}
            leads = [100 * (s["val_last"] - theirs[seed]) for seed, s, _, _ in results[base] if seed in theirs]
            if not leads:
                continue
            p = paired_lead(leads)
            sig = "yes" if p["low"] > 0 or p["high"] < 0 else "no"
            lines.append(f"| {other} | {axis} | {p['n']} | {p['mean']:+.1f} | [{p['low']:+.1f}, {p['high']:+.1f}] | "
                         f"{p['wins']} / {p['losses']} | {p['sign_p']:.3f} | {sig} |")
    table = "\n".join(lines) + "\n"
    path.write_text(table)
    return table


def plot(curves: dict[str, list[list[dict]]], path: Path) -> None:
    """Held-out accuracy per seed against generated tokens (left) and against RL steps (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for index, (name, runs) in enumerate(curves.items()):
        color = f"C{index}"
        for i, rows in enumerate(runs):
            tokens, steps, acc, total = [], [], [], 0.0
            for r in rows:
                total += r.get("train/num_generated_tokens", 0.0)
                if r.get("val/acc") is not None:
                    tokens.append(total)
                    steps.append(r["step"])
                    acc.append(r["val/acc"])
            for ax, x in zip(axes, (tokens, steps), strict=True):
                ax.plot(x, acc, marker="o", markersize=2, color=color, alpha=0.7, label=name if i == 0 else None)
    axes[0].set(title="held-out acc (avg@4, T=1.0, top_p=0.7) per seed", xlabel="generated tokens", ylabel="acc")
    axes[1].set(title="the same runs against RL steps", xlabel="RL step")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_seed(seed: int, kinds: list[str], args: argparse.Namespace, threads: int | None) -> list[tuple]:
    """Every run kind of one seed, DAPO first (its total generated tokens are the others' budget)."""
    out, budget = [], None
    by_tokens = args.equal == "tokens"
    for kind in kinds:
        spec = RUNS[kind]
        other = kind != "dapo" and "dapo" in kinds
        steps = round(args.steps * args.steps_factor) if other and by_tokens else args.steps
        run_dir = args.out / f"{kind}_seed{seed}{EQUAL[args.equal][1] if other else ''}"
        wall = run_one(spec, run_dir, seed, steps, args.overrides, budget=budget, threads=threads)
        rows, reached = cut_at_budget(read_rows(run_dir), budget)
        if kind == "dapo" and by_tokens:
            budget = generated_tokens(rows)
        s = summarize(rows)
        print(f"{spec.label} seed {seed}: held-out avg@4 first {s['val_first']:.3f} last {s['val_last']:.3f} "
              f"best {s['val_best']:.3f} ({s['gain_points']:+.1f} points), {wall:.0f} s", flush=True)
        out.append((kind, seed, s, wall, reached, rows))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "ablation", help="output directory")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[42],
                        help="comma-separated trainer.seed values, e.g. 1,2,3")
    parser.add_argument("--runs", default="dapo,grpo", help=f"runs per seed, comma-separated, from: {','.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=None,
                        help="RL steps of the DAPO run (default: the default run's trainer.total_training_steps)")
    parser.add_argument("--steps-factor", "--grpo-steps-factor", type=float, default=3.0,
                        help="with --equal tokens, the other runs may take this many times DAPO's steps; "
                             "they stop at DAPO's token budget")
    parser.add_argument("--equal", choices=tuple(EQUAL), default="tokens",
                        help="match the other runs to DAPO's generated tokens (default) or its RL steps")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once (threads split between them)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = default_dapo_steps()
    kinds = args.runs.split(",")
    if any(k not in RUNS for k in kinds):
        parser.error(f"--runs {args.runs}: choose from {','.join(RUNS)}")
    if "dapo" in kinds:
        kinds = ["dapo"] + [k for k in kinds if k != "dapo"]
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        per_seed = list(pool.map(lambda s: run_seed(s, kinds, args, threads), args.seeds))
    results: dict[str, list[tuple[int, dict[str, float], float, bool]]] = {RUNS[k].label: [] for k in kinds}
    curves: dict[str, list[list[dict]]] = {RUNS[k].label: [] for k in kinds}
    for runs in per_seed:
        for kind, seed, s, wall, reached, rows in runs:
            results[RUNS[kind].label].append((seed, s, wall, reached))
            curves[RUNS[kind].label].append(rows)
    axis, suffix = EQUAL[args.equal]
    print(write_table(results, args.out / f"ablation{suffix}.md", axis), end="")
    plot(curves, args.out / f"ablation{suffix}.png")
    print(f"wrote {args.out / f'ablation{suffix}.md'} and {args.out / f'ablation{suffix}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
