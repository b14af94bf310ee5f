"""Plots the curves that tell whether a DAPO run learns, from its metrics.jsonl.

    python tools/plot_metrics.py RUN_DIR [RUN_DIR ...] [--out PNG]

One panel per question: is the training score rising, does validation accuracy
follow, is the reward (score + overlong shaping) tracking it, is entropy collapsing,
are responses growing into the length limit, how much of the update is clipped, and
how many generation rounds dynamic sampling needs per step. Panels whose metrics the
run did not log are left out. Works headless (Agg backend). The PNG goes to
RUN_DIR/metrics.png unless --out says otherwise.

Several run directories (the same experiment over seeds) draw each metric as the mean
over the runs that logged it at that step, with a band from their minimum to their
maximum; the PNG then goes to their common parent (metrics.png) unless --out says otherwise.

Self-contained (json + matplotlib) so it runs from a checkout without installing the
package, e.g. on a login node against a run directory on shared storage.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
from pathlib import Path

# (panel title, fnmatch patterns of the metric keys drawn in it), in display order.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Training score / accuracy", ("critic/score/mean", "train/acc*", "critic/acc*")),
    ("Validation accuracy", ("val*acc*", "val*score*")),
    ("Reward (score + length shaping)", ("critic/rewards/mean", "critic/advantages/mean")),
    ("Entropy", ("actor/entropy*",)),
    ("Response length (tokens)", ("response_length/mean", "response_length/max")),
    ("Clip fractions", ("actor/pg_clipfrac*", "response_length/clip_ratio")),
    ("Generation rounds per step", ("train/num_gen_batches",)),
    ("MoE routing", ("moe/load_imbalance", "moe/load_imbalance_max", "moe/router_entropy")),
)


def read_rows(path: Path) -> list[dict]:
    """Reads metrics.jsonl, skipping a torn last line left by a killed run.

    Args:
        path: the metrics.jsonl file.

    Returns:
        One dict per step.
    """
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """The (steps, values) of one metric, leaving out steps where it is missing or not finite.

    Args:
        rows: metrics rows.
        key: metric name.

    Returns:
        Steps and values of equal length.
    """
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            steps.append(row["step"])
            values.append(float(value))
    return steps, values


def panel_keys(rows: list[dict], patterns: tuple[str, ...]) -> list[str]:
    """The logged metric names matching a panel's patterns, in pattern order.

    Args:
        rows: metrics rows.
        patterns: fnmatch patterns.

    Returns:
        Matching keys, each once.
    """
    all_keys = sorted({key for row in rows for key in row if key != "step"})
    keys: list[str] = []
    for pattern in patterns:
        keys.extend(k for k in all_keys if fnmatch.fnmatchcase(k, pattern) and k not in keys)
    return keys


def band(runs: list[list[dict]], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Mean, minimum and maximum of one metric over runs, at every step some run logged it.

    Args:
        runs: the metrics rows of each run.
        key: metric name.

    Returns:
        (steps, means, minima, maxima), of equal length, steps ascending.
    """
    by_step: dict[int, list[float]] = {}
    for rows in runs:
        for step, value in zip(*series(rows, key)):
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    values = [by_step[s] for s in steps]
    return steps, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def plot(rows: list[dict] | list[list[dict]], out: Path, title: str) -> int:
    """Draws the panels that have data and writes a PNG.

    Args:
        rows: metrics rows of one run, or a list of runs' rows (mean curve and min/max band).
        out: PNG path.
        title: figure title (the run directory's name).

    Returns:
        The number of panels drawn.
    """
    runs = rows if rows and isinstance(rows[0], list) else [rows]  # type: ignore[list-item]
    rows = [row for run in runs for row in run]  # type: ignore[union-attr]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, keys) for name, patterns in PANELS if (keys := panel_keys(rows, patterns))]
    if not panels:
        # Still draw something useful for a run logging only unfamiliar names.
        panels = [("All metrics", panel_keys(rows, ("*",)))]
    num_cols = 2
    num_rows = math.ceil(len(panels) / num_cols)
    fig, axes = plt.subplots(num_rows, num_cols, figsize=(12, 3.2 * num_rows), squeeze=False)
    for ax, (name, keys) in zip(axes.flat, panels):
        for key in keys:
            if len(runs) == 1:
                steps, values = series(rows, key)
                ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=key)
                continue
            steps, mean, low, high = band(runs, key)  # type: ignore[arg-type]
            (line,) = ax.plot(steps, mean, marker="." if len(steps) < 50 else None,
                              label=f"{key} (mean of {len(runs)}, min-max band)")
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return len(panels)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Args:
        argv: arguments (sys.argv[1:] when None).

    Returns:
        0 on success, 2 when the metrics file is missing or has no steps.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, nargs="+",
                        help="run directory holding metrics.jsonl; several: mean curve and min/max band")
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG to write (default RUN_DIR/metrics.png, or the runs' common parent)")
    args = parser.parse_args(argv)
    runs: list[list[dict]] = []
    for run_dir in args.run_dir:
        path = run_dir / "metrics.jsonl"
        if not path.is_file():
            print(f"error: {path} does not exist; pass the run's output directory", file=sys.stderr)
            return 2
        rows = read_rows(path)
        if not rows:
            print(f"error: {path} has no complete step yet; plot after the first step finished", file=sys.stderr)
            return 2
        runs.append(rows)
    if len(runs) == 1:
        out = args.out or args.run_dir[0] / "metrics.png"
        num_panels = plot(runs[0], out, title=args.run_dir[0].resolve().name)
        print(f"wrote {out} ({num_panels} panels, {len(runs[0])} steps)")
        return 0
    dirs = [d.resolve() for d in args.run_dir]
    parent = Path(os.path.commonpath(dirs))
    out = args.out or parent / "metrics.png"
    names = [d.name for d in dirs]
    if len(names) > 4:  # a title wider than the figure is cut at both ends
        names = [*names[:2], "...", names[-1]]
    num_panels = plot(runs, out, title=f"{parent.name}: {len(runs)} runs ({', '.join(names)})")
    print(f"wrote {out} ({num_panels} panels, {len(runs)} runs, {max(len(r) for r in runs)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
