"""Routing replay off, R2 and R3, with and without token TIS, on the tiny MoE run with a real routing mismatch.

    python benchmarks/routing_replay.py                                  # 6 variants x seeds 1,2,3, 40 steps
    python benchmarks/routing_replay.py --seeds 1 --steps 10 --variants off,r3   # a quick look

The mismatch: the local engine chooses its experts on router logits + N(0, sigma^2)
(`rollout.router_noise_std`, default sigma 0.3; the gates stay clean), the way kernels that
break near-ties differently do; on a CPU the engine and the actor are otherwise equal to
3e-7. Each run is examples/tiny_moe_cpu.yaml (warm start from the cache, held-out every 10
steps) with `trainer.seed=<s>`, in a fresh process, one at a time; with --warm-start every seed
starts RL from that one SFT'd checkpoint (each seed's own warm start costs ~550 SFT steps). Per variant, over seeds
(mean and sample std): moe/router_disagreement, rollout_corr/kl_k3 (the mismatch KL of the
engine's and the actor's old log-probs), rollout/train_logprob_abs_diff (the log-prob gap),
the held-out accuracy at the last step and its gain over step 0, the median update time;
then a reference row for the same MoE without noise and for the dense tiny run (examples/
tiny_cpu.yaml, no warm start: the gap does not depend on it). Writes the markdown table to
stdout and the plot to docs/routing_replay.png. A finished run (its metrics.jsonl) is not run again,
so running the same command again only summarizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIS = ["algorithm.rollout_correction.rollout_is=token"]
VARIANTS: dict[str, list[str]] = {
    "off": ["algorithm.routing_replay=off"],
    "off+tis": ["algorithm.routing_replay=off", *TIS],
    "r2": ["algorithm.routing_replay=old_policy"],
    "r2+tis": ["algorithm.routing_replay=old_policy", *TIS],
    "r3": ["algorithm.routing_replay=rollout"],
    "r3+tis": ["algorithm.routing_replay=rollout", *TIS],
}
REFERENCES: dict[str, tuple[str, list[str]]] = {
    # The same MoE without the perturbation, and the dense run: what "no mismatch" looks like.
    "moe, no noise": ("examples/tiny_moe_cpu.yaml", ["rollout.router_noise_std=0.0"]),
    "dense": ("examples/tiny_cpu.yaml", ["model.sft_warm_start.enable=false", "algorithm.filter_groups.enable=false"]),
}


def run(config: str, overrides: list[str], out_dir: Path) -> list[dict]:
    if not (out_dir / "metrics.jsonl").is_file():
        command = [sys.executable, "-m", "megatron_dapo.train", config, "trainer.save_interval=0",
                   "trainer.resume=disable", "logging.console=false", f"trainer.output_dir={out_dir}", *overrides]
        subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, env={**os.environ})
    with (out_dir / "metrics.jsonl").open() as f:
        return [json.loads(line) for line in f]


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r and r["step"] > 0]
    return sum(values) / len(values) if values else float("nan")


def per_run(rows: list[dict]) -> dict[str, float]:
    vals = [r for r in rows if "val/acc" in r]
    return {
        "disagreement": _mean(rows, "moe/router_disagreement"),
        "mismatch": _mean(rows, "moe/replay_route_mismatch"),
        "kl_k3": _mean(rows, "rollout_corr/kl_k3"),
        "gap": _mean(rows, "rollout/train_logprob_abs_diff"),
        "val_last": vals[-1]["val/acc"] if vals else float("nan"),
        "val_gain": vals[-1]["val/acc"] - vals[0]["val/acc"] if len(vals) > 1 else float("nan"),
        "update_s": statistics.median([r["timing_s/update_actor"] for r in rows if "timing_s/update_actor" in r]),
    }


def _fmt(values: list[float], digits: str) -> str:
    if any(v != v for v in values):  # nan: the metric does not exist in this variant
        return "-"
    if len(values) == 1:
        return format(values[0], digits)
    return f"{format(statistics.mean(values), digits)} ± {format(statistics.stdev(values), digits)}"


def summarize(results: dict[str, list[dict[str, float]]]) -> str:
    lines = ["| variant | seeds | router disagreement | replay mismatch | mismatch KL (k3) | log-prob gap | "
             "held-out acc, last | gain over step 0 | update s (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        col = {k: [r[k] for r in runs] for k in runs[0]}
        lines.append(f"| {name} | {len(runs)} | {_fmt(col['disagreement'], '.4f')} | {_fmt(col['mismatch'], '.0f')} | "
                     f"{_fmt(col['kl_k3'], '.2e')} | {_fmt(col['gap'], '.2e')} | {_fmt(col['val_last'], '.3f')} | "
                     f"{_fmt(col['val_gain'], '+.3f')} | {_fmt(col['update_s'], '.2f')} |")
    return "\n".join(lines)


def plot(curves: dict[str, list[list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_gap, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in curves.items():
        steps = sorted({r["step"] for rows in runs for r in rows if "rollout/train_logprob_abs_diff" in r})
        gap = [statistics.mean(r["rollout/train_logprob_abs_diff"] for rows in runs for r in rows
                               if r["step"] == s and "rollout/train_logprob_abs_diff" in r) for s in steps]
        style = "--" if name in REFERENCES else "-"
        ax_gap.plot(steps, gap, style, label=name)
        val_steps = sorted({r["step"] for rows in runs for r in rows if "val/acc" in r})
        if val_steps and name not in REFERENCES:
            acc = [statistics.mean(r["val/acc"] for rows in runs for r in rows if r["step"] == s and "val/acc" in r)
                   for s in val_steps]
            ax_acc.plot(val_steps, acc, style, marker="o", label=name)
    ax_gap.set_yscale("log")
    ax_gap.set(xlabel="RL step", ylabel="mean |engine - actor| log-prob", title="log-prob gap (mean over seeds)")
    ax_acc.set(xlabel="RL step", ylabel="held-out accuracy (avg@4)", title="held-out accuracy (mean over seeds)")
    for ax in (ax_gap, ax_acc):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--noise", type=float, default=0.3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default="runs/routing_replay")
    parser.add_argument("--plot", default="docs/routing_replay.png")
    parser.add_argument("--warm-start", default=None,
                        help="an SFT'd HF checkpoint every seed starts from (seeds then vary the RL run only)")
    args = parser.parse_args()
    out = REPO / args.out
    seeds = [int(s) for s in args.seeds.split(",")]
    common = [f"trainer.total_training_steps={args.steps}", "trainer.test_freq=10"]
    if args.warm_start:
        common += [f"model.hf_checkpoint={args.warm_start}", "model.sft_warm_start.enable=false"]
    results: dict[str, list[dict[str, float]]] = {}
    curves: dict[str, list[list[dict]]] = {}
    for name in args.variants.split(","):
        for seed in seeds:
            rows = run("examples/tiny_moe_cpu.yaml", [*common, f"trainer.seed={seed}",
                                                      f"rollout.router_noise_std={args.noise}", *VARIANTS[name]],
                       out / f"{name}-s{seed}")
            results.setdefault(name, []).append(per_run(rows))
            curves.setdefault(name, []).append(rows)
            print(name, seed, results[name][-1], flush=True)
    for name, (config, overrides) in REFERENCES.items():
        start = common[2:] if name != "dense" else []
        rows = run(config, ["trainer.total_training_steps=10", "trainer.test_freq=0", f"trainer.seed={seeds[0]}",
                            *start, *overrides], out / name.replace(", ", "-").replace(" ", "_"))
        results[name] = [per_run(rows)]
        curves[name] = [rows]
    print(summarize(results))
    plot(curves, REPO / args.plot)


if __name__ == "__main__":
    main()
