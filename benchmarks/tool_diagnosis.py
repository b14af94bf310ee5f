"""Why the tool-calling example learns on some seeds and not others (issue 63 item 1).

    python benchmarks/tool_diagnosis.py --seeds 10                       # train, then evaluate every checkpoint
    python benchmarks/tool_diagnosis.py --seeds 10 --read                # only read what is under --root
    python benchmarks/tool_diagnosis.py --seeds 10 --root /tmp/td-share1 -- model.sft_warm_start.num_steps=900

Per seed, the tool run of examples/tiny_tools_cpu.yaml (with the overrides after ``--``) under
``<root>/<seed>``; then `megatron-dapo eval` of its warm start and of each saved checkpoint on
the held-out prompts (the run's own validation draw), split by problem kind: the 3-digit x
2-digit products (``big_mul``: the ones that need the calculator) and the +/- problems worked
by hand. Printed per evaluation: call rate and accuracy per kind, the products' accuracy when
they call and when they do not, and how often a call is malformed or answered with an error;
then, from the training metrics in blocks of steps, where the reward for calling goes
(tools/outcomes.py): accuracy of episodes that call against those that do not, the share of
groups in which some episodes call and some do not, the share of those dynamic sampling keeps,
the call rate of the kept batch against everything generated.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "tiny_tools_cpu.yaml"
TRAIN_KEYS = ("tools/call_rate", "tools/call_rate_kept", "tools/acc_called", "tools/acc_not_called",
              "tools/mixed_call_groups", "tools/mixed_call_groups_kept", "tools/error_rate", "tools/turn_capped",
              "train/acc_all_generated", "train/num_gen_batches")


def run(command: list[str], log: Path) -> None:
    print("$", " ".join(str(c) for c in command), flush=True)
    with log.open("w") as f:
        subprocess.run(command, cwd=REPO, check=True, stdout=f, stderr=subprocess.STDOUT, env={**os.environ})


def warm_start_dir(log: Path) -> Path:
    """The warm start the run used (run.py logs it)."""
    found = re.findall(r"sft warm start: (\S+) \(", log.read_text(errors="replace"))
    if not found:
        raise SystemExit(f"{log}: no 'sft warm start:' line; rerun the training with this repository's code")
    return Path(found[-1])


def val_file(overrides: list[str]) -> tuple[Path, list[dict]]:
    """The held-out prompt file and its rows, in order (their extra_info has each problem's kind)."""
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.embedded import cache_root, task_of

    path = task_of(load_config(CONFIG, overrides), cache_root()).val_path
    return path, [json.loads(line) for line in path.open()]


def evaluate(checkpoint: Path, out: Path, val_path: Path, seed: int, overrides: list[str]) -> list[dict]:
    if not out.exists():
        command = [sys.executable, "-m", "megatron_dapo.cli", "eval", str(checkpoint), "--data", str(val_path),
                   "--seed", str(seed + 2), "--out", str(out), "--no-progress"]
        if not (checkpoint / "manifest.json").exists():
            command += ["--config", str(CONFIG)]  # an HF directory (the warm start) has no stored config
        run(command, out.with_suffix(".log"))
    return [json.loads(line) for line in out.open()]


def split(rows: list[dict], kinds: list[str]) -> dict[str, float]:
    """Call rate and accuracy per kind, and the products' accuracy with and without a call."""
    by = defaultdict(list)
    for r in rows:
        by["product" if kinds[r["row"]] == "big_mul" else "by hand"].append(r)
    out: dict[str, float] = {}
    for kind, rs in by.items():
        called = [r for r in rs if r.get("episode", {}).get("calls")]
        plain = [r for r in rs if not r.get("episode", {}).get("calls")]
        out[f"{kind} call rate"] = len(called) / len(rs)
        out[f"{kind} acc"] = sum(r["acc"] for r in rs) / len(rs)
        if kind == "product":
            out["product acc called"] = sum(r["acc"] for r in called) / len(called) if called else float("nan")
            out["product acc not called"] = sum(r["acc"] for r in plain) / len(plain) if plain else float("nan")
            calls = [c for r in called for c in r["episode"]["calls"]]
            out["product call errors"] = sum(c["status"] != "ok" for c in calls) / len(calls) if calls else 0.0
    out["all acc"] = sum(r["acc"] for r in rows) / len(rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/tmp/tool-diagnosis"))
    parser.add_argument("--seeds", default="10")
    parser.add_argument("--block", type=int, default=10, help="training steps per row of the training table")
    parser.add_argument("--read", action="store_true", help="only read what is already under --root")
    parser.add_argument("overrides", nargs="*", help="config overrides for the tool run (after --)")
    args = parser.parse_args()
    val_path, rows_of_val = val_file(args.overrides)
    kinds = [r["extra_info"]["kind"] for r in rows_of_val]
    for seed in (int(s) for s in args.seeds.split(",")):
        out = (args.root / str(seed)).resolve()
        log = out.parent / f"{seed}.log"
        if not args.read and not (out / "metrics.jsonl").exists():
            out.mkdir(parents=True, exist_ok=True)
            run([sys.executable, "-m", "megatron_dapo.train", str(CONFIG), f"trainer.seed={seed}",
                 f"trainer.output_dir={out}", "trainer.max_checkpoints_to_keep=0", *args.overrides], log)
        checkpoints = sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        evals = {0: warm_start_dir(log), **{int(p.name.split("_")[1]): p for p in checkpoints}}
        table = {}
        for step, ckpt in evals.items():
            table[step] = split(evaluate(ckpt, out.parent / f"{seed}-eval-{step}.jsonl", val_path, seed, args.overrides),
                                kinds)
        print(f"\nseed {seed}: held-out, {len(rows_of_val)} prompts "
              f"({sum(k == 'big_mul' for k in kinds)} products), the run's validation draw")
        keys = list(next(iter(table.values())))
        print("| step | " + " | ".join(keys) + " |")
        print("|---|" + "---|" * len(keys))
        for step, m in table.items():
            print(f"| {step} | " + " | ".join(f"{m.get(k, float('nan')):.3f}" for k in keys) + " |")
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        print(f"\nseed {seed}: training, mean over blocks of {args.block} steps")
        print("| steps | " + " | ".join(TRAIN_KEYS) + " |")
        print("|---|" + "---|" * len(TRAIN_KEYS))
        train_rows = [m for m in metrics if m["step"] > 0 and "tools/call_rate" in m]
        for start in range(0, len(train_rows), args.block):
            block = train_rows[start:start + args.block]
            cells = []
            for k in TRAIN_KEYS:
                vals = [m[k] for m in block if k in m]
                cells.append(f"{sum(vals) / len(vals):.3f}" if vals else "-")
            print(f"| {block[0]['step']}-{block[-1]['step']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
