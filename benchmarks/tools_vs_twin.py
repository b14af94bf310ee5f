"""The tool-calling example against its no-tool twin, seed by seed (issue 63 item 3).

    python benchmarks/tools_vs_twin.py --seeds 6301,6302,...      # every run, one at a time, then the table
    python benchmarks/tools_vs_twin.py --seeds ... --read         # only read the runs under --root
    python benchmarks/tools_vs_twin.py --seeds ... --read --plot docs/tools_seeds.png

Per seed S, from S's warm start (cached, the same checkpoint for both runs):

    tools   python -m megatron_dapo.train examples/tiny_tools_cpu.yaml trainer.seed=S
    twin    the same with tools.enable=false (its calls go unanswered, in training and held out),
            started from the tool run's warm start (model.hf_checkpoint=<it>, the task's files as
            data.train_files / data.val_files): the warm start stops in a held-out band that
            the tool run's checks measure with the calculator, so the twin's own would differ

then `megatron-dapo eval` of the tool run's last checkpoint on the held-out prompts (the run's
own validation draw) for the call rate on the problems that need the calculator (the 3-digit x
2-digit products). A seed meets the bar when the tool run gains >= --min-gain held-out points,
ends with a call rate >= --min-call-rate on those products, beats its twin by >= --min-lead
points, and each of its two runs takes <= --max-minutes (warm start included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tool_diagnosis import CONFIG, REPO, evaluate, split, val_file, warm_start_dir


def train(out: Path, seed: int, overrides: list[str]) -> None:
    """One run in a fresh process, unless it is complete; its wall seconds go to <out>.wall."""
    wall = out.with_suffix(".wall")
    if wall.exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "megatron_dapo.train", str(CONFIG), f"trainer.seed={seed}",
               f"trainer.output_dir={out}", *overrides]
    print("$", " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    with out.with_suffix(".log").open("w") as log:
        subprocess.run(command, cwd=REPO, check=True, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    wall.write_text(f"{time.perf_counter() - start:.1f}\n")


def accuracies(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["val/acc"]) for r in map(json.loads, (out / "metrics.jsonl").open()) if "val/acc" in r]


def plot(root: Path, seeds: list[int], out: Path) -> None:
    """Held-out accuracy of the tool runs and of their twins over the steps: mean and min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for kind, label, color in (("tools", "with the calculator", "tab:blue"), ("twin", "no-tool twin", "tab:gray")):
        runs = [dict(accuracies(root / str(s) / kind)) for s in seeds]
        steps = sorted(set.intersection(*(set(r) for r in runs)))
        values = [[r[step] for r in runs] for step in steps]
        ax.plot(steps, [sum(v) / len(v) for v in values], color=color, label=f"{label} (mean of {len(runs)} seeds)")
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.2)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out accuracy (avg@4)")
    ax.set_title(f"examples/tiny_tools_cpu.yaml, seeds {seeds[0]}-{seeds[-1]} (band: min-max)", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/tmp/tools-vs-twin"))
    parser.add_argument("--seeds", required=True)
    parser.add_argument("--read", action="store_true")
    parser.add_argument("--min-gain", type=float, default=15.0)
    parser.add_argument("--min-call-rate", type=float, default=0.8)
    parser.add_argument("--min-lead", type=float, default=10.0)
    parser.add_argument("--max-minutes", type=float, default=15.0)
    parser.add_argument("--plot", type=Path, help="also draw the runs' held-out accuracy to this PNG")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    root = args.root.resolve()
    val_path, val_rows = val_file([])
    train_path = val_path.with_name("train.jsonl")
    if not args.read:
        for seed in seeds:
            tools = root / str(seed) / "tools"
            train(tools, seed, [])
            train(root / str(seed) / "twin", seed, [
                "tools.enable=false", f"model.hf_checkpoint={warm_start_dir(tools.with_suffix('.log'))}",
                f"data.train_files=[{train_path}]", f"data.val_files=[{val_path}]"])
    kinds = [r["extra_info"]["kind"] for r in val_rows]
    print("| seed | tools: held-out at each validation | gain | twin: first -> last | tools - twin | "
          "call rate on products (held-out, last step) | minutes (tools / twin) | meets |")
    print("|---|---|---|---|---|---|---|---|")
    met = 0
    for seed in seeds:
        tools, twin = root / str(seed) / "tools", root / str(seed) / "twin"
        if not (tools.with_suffix(".wall").exists() and twin.with_suffix(".wall").exists()):
            continue
        t, w = accuracies(tools), accuracies(twin)
        last = max((p for p in (tools / "checkpoints").glob("step_*")), key=lambda p: int(p.name.split("_")[1]))
        rate = split(evaluate(last, tools.parent / "tools-eval-last.jsonl", val_path, seed, []), kinds)["product call rate"]
        gain, lead = 100 * (t[-1][1] - t[0][1]), 100 * (t[-1][1] - w[-1][1])
        minutes = [float(p.with_suffix(".wall").read_text()) / 60 for p in (tools, twin)]
        ok = (gain >= args.min_gain and rate >= args.min_call_rate and lead >= args.min_lead
              and max(minutes) <= args.max_minutes)
        met += ok
        print(f"| {seed} | " + " -> ".join(f"{a:.3f}" for _, a in t) + f" | {gain:+.1f} | {w[0][1]:.3f} -> {w[-1][1]:.3f} "
              f"| {lead:+.1f} | {rate:.3f} | {minutes[0]:.1f} / {minutes[1]:.1f} | {'yes' if ok else 'no'} |")
    if args.plot is not None:
        plot(root, seeds, args.plot)
    print(f"\n{met} of {len(seeds)} seeds meet every bar (gain >= {args.min_gain:g}, call rate >= "
          f"{args.min_call_rate:g}, lead >= {args.min_lead:g}, <= {args.max_minutes:g} min per run)")


if __name__ == "__main__":
    main()
