"""DAPO vs naive GRPO on the tiny task, like the paper's ablation in miniature.

    python tools/ablate.py [--out runs/ablation] [--steps N] [key=value ...]

Runs examples/tiny_cpu.yaml (DAPO) and examples/grpo_tiny_cpu.yaml (symmetric clip 0.2,
seq-mean-token-mean, no dynamic sampling, no overlong shaping) one after the other with
the same model, SFT warm start (shared cache), data order and seeds, then writes
`<out>/ablation.md` (a table) and `<out>/ablation.png` (held-out accuracy and training
accuracy per step). Extra `key=value` overrides apply to both runs. Report what comes
out, whatever it is: on a model this small the difference between the two is noisy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = {"DAPO": "examples/tiny_cpu.yaml", "GRPO (naive)": "examples/grpo_tiny_cpu.yaml"}


def run_one(config: str, out_dir: Path, steps: int | None, overrides: list[str]) -> float:
    """Train one config into out_dir (fresh); returns wall seconds."""
    extra = [f"trainer.output_dir={out_dir}", "trainer.resume=disable", *overrides]
    if steps is not None:
        extra.append(f"trainer.total_training_steps={steps}")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "megatron_dapo.train", str(REPO / config), *extra], cwd=REPO, check=True)
    return time.perf_counter() - start


def read_rows(out_dir: Path) -> list[dict]:
    with (out_dir / "metrics.jsonl").open() as f:
        return [json.loads(line) for line in f]


def summarize(rows: list[dict]) -> dict[str, float]:
    val = [(r["step"], r["val/acc"]) for r in rows if r.get("val/acc") is not None]
    train = [r for r in rows if "train/acc_all_generated" in r]
    return {
        "val_first": val[0][1] if val else float("nan"),
        "val_last": val[-1][1] if val else float("nan"),
        "val_best": max(v for _, v in val) if val else float("nan"),
        "gen_rounds": sum(r["train/num_gen_batches"] for r in train) / max(len(train), 1),
        "entropy_last": train[-1]["actor/entropy"] if train else float("nan"),
        "resp_len_last": train[-1]["response_length/mean"] if train else float("nan"),
    }


def write_table(results: dict[str, tuple[dict[str, float], float]], path: Path) -> str:
    lines = [
        "| run | val acc first | val acc last | gain (points) | best | gen rounds/step | entropy (last) | "
        "response len (last) | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (s, wall) in results.items():
        gain = 100 * (s["val_last"] - s["val_first"])
        lines.append(f"| {name} | {s['val_first']:.3f} | {s['val_last']:.3f} | {gain:+.1f} | {s['val_best']:.3f} | "
                     f"{s['gen_rounds']:.2f} | {s['entropy_last']:.3f} | {s['resp_len_last']:.1f} | {wall:.0f} |")
    table = "\n".join(lines) + "\n"
    path.write_text(table)
    return table


def plot(all_rows: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, rows in all_rows.items():
        val = [(r["step"], r["val/acc"]) for r in rows if r.get("val/acc") is not None]
        axes[0].plot(*zip(*val), marker="o", label=name)
        train = [(r["step"], r["train/acc_all_generated"]) for r in rows if "train/acc_all_generated" in r]
        axes[1].plot(*zip(*train), label=name)
    axes[0].set(title="held-out accuracy (avg@k, T=1.0, top_p=0.7)", xlabel="step", ylabel="acc")
    axes[1].set(title="accuracy of all generated responses", xlabel="step", ylabel="acc")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "ablation", help="output directory")
    parser.add_argument("--steps", type=int, default=None, help="RL steps of each run (default: the configs')")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to both runs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, tuple[dict[str, float], float]] = {}
    all_rows: dict[str, list[dict]] = {}
    for name, config in RUNS.items():
        run_dir = args.out / Path(config).stem
        wall = run_one(config, run_dir, args.steps, args.overrides)
        all_rows[name] = read_rows(run_dir)
        results[name] = (summarize(all_rows[name]), wall)
    print(write_table(results, args.out / "ablation.md"), end="")
    plot(all_rows, args.out / "ablation.png")
    print(f"wrote {args.out / 'ablation.md'} and {args.out / 'ablation.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
