"""A fleet's weight sync under pipeline parallelism: one group per stage against one group fed by a gather.

    python benchmarks/fleet_stages.py [--engine vllm|sglang] [--engines 1] [--steps 6] [--rounds 2] [--hidden 512]

The tiny run of examples/tiny_cpu.yaml (scratch model, no warm start, no dynamic sampling: the
scratch model solves nothing and every group is kept; widened to --hidden so the sync moves more
than the tiny model's 3 MB) on two ranks at TP 1 x PP 2 with a fleet of --engines servers, max_staleness 0 (the sync sits between the steps), once per variant per round, the
variants interleaved round by round:

    stages   rollout.fleet_stage_groups=true (the default): stage 1's first rank broadcasts its
             own stage's buckets in a group of its own (rollout/fleet/stages.py)
    gather   rollout.fleet_stage_groups=false: stage 1's tensors go to the controller first, which
             broadcasts everything in one group (verl's way; the baseline)

Prints per variant the median of timing_s/sync over the steps (the whole step 7 on the controller:
export, turns, broadcasts, the servers' loads, the finish), the bytes per sync, and the ratio
gather / stages (> 1: the per-stage groups are faster). On one machine the second crossing the
per-stage groups save is a loopback copy; between nodes it is a network hop of half the model.
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

VARIANTS = {"stages": "rollout.fleet_stage_groups=true", "gather": "rollout.fleet_stage_groups=false"}


def run(variant: str, args: argparse.Namespace, workdir: Path) -> dict:
    out = workdir / f"{variant}-{time.monotonic_ns()}"
    heads = max(4, args.hidden // 64)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "megatron_dapo.train", str(REPO / "examples" / "tiny_cpu.yaml"),
        f"rollout.engine={args.engine}", "rollout.placement=disaggregated", f"rollout.num_engines={args.engines}",
        "parallel.pipeline_model_parallel_size=2", "model.sft_warm_start.enable=false",
        "algorithm.filter_groups.enable=false",  # the scratch model solves nothing: keep every group
        f"model.scratch.hidden_size={args.hidden}", f"model.scratch.num_attention_heads={heads}",
        f"model.scratch.num_key_value_heads={heads // 2}", f"model.scratch.intermediate_size={3 * args.hidden}",
        "trainer.save_interval=1000", "trainer.test_freq=1000", "trainer.val_before_train=false",
        f"trainer.total_training_steps={args.steps}", "data.train_batch_size=8", "data.gen_batch_size=8",
        "trainer.ppo_mini_batch_size=8", f"trainer.output_dir={out}", VARIANTS[variant],
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_DAPO_CACHE": str(workdir / "cache")}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/sync" in r]
    return {"sync": [r["timing_s/sync"] for r in rows], "bytes": rows[-1]["sync/num_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="vllm", choices=["vllm", "sglang"])
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    results: dict[str, dict] = {v: {"sync": [], "bytes": 0} for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="fleet_stages_") as tmp:
        for round_ in range(args.rounds):
            for variant in VARIANTS:
                got = run(variant, args, Path(tmp))
                results[variant]["sync"] += got["sync"]
                results[variant]["bytes"] = got["bytes"]
                print(f"round {round_ + 1} {variant}: sync {statistics.median(got['sync']):.3f} s", flush=True)
    print(f"\n{args.engine} x {args.engines}, TP 1 x PP 2 on 2 ranks, hidden {args.hidden}, "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"{'variant':<8} {'sync median s':>14} {'MB per sync':>12} {'gather / this':>14}")
    base = statistics.median(results["gather"]["sync"])
    for variant, r in results.items():
        median = statistics.median(r["sync"])
        print(f"{variant:<8} {median:>14.3f} {r['bytes'] / 1e6:>12.1f} {base / median:>14.2f}")


if __name__ == "__main__":
    main()
