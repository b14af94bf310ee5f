"""On-policy distillation against its DAPO twin on the embedded task (issue 61 item 5).

    python benchmarks/distill_vs_dapo.py                        # teacher, then seeds 211-213, one run at a time
    python benchmarks/distill_vs_dapo.py --read                 # only read the runs under --root
    python benchmarks/distill_vs_dapo.py --seeds 301 --root /tmp/distill-tuning --distill <override> ...
    python benchmarks/distill_vs_dapo.py --seeds 201,202,203 --teacher-steps 160 --root /tmp/distill  # 2026-12-02's first protocol

The teacher is the default run of examples/tiny_cpu.yaml at --teacher-seed trained for
--teacher-steps (longer than the runs it is compared with: a teacher no better than what DAPO
reaches in the same steps has nothing to teach, benchmarks.md 2026-12-02), its last checkpoint
exported to HF (`megatron-dapo convert mcore-to-hf`); its held-out val/acc at its last step is
the teacher accuracy, and the target is that minus --margin (3 points). Per seed S, from S's SFT
warm start (cached, the same checkpoint for both):

    distill  on-policy distillation: algorithm.distill.teacher=<teacher HF dir> plus --distill's
             overrides (default: pure distillation, coef 1 and reward_weight 0, dynamic sampling
             off, which the config requires with reward_weight 0)
    dapo     the default run, the baseline

Each run validates every trainer.test_freq steps. A run reaches the target at its first
validation with val/acc >= target; "tokens" are the training rollouts' generated tokens up to
that step (the sum of train/num_generated_tokens; validation generation is the same for both
and not counted). Prints every validation of every run, then per seed the steps and tokens to
the target and their ratio to the DAPO twin's (distill / dapo; "-" where DAPO never reaches it).
Runs already complete under --root are read, not rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "examples/tiny_cpu.yaml"
DISTILL = ["algorithm.filter_groups.enable=false"]  # pure: coef 1 and reward_weight 0 are the defaults


@dataclass(frozen=True, slots=True)
class Validation:
    step: int
    acc: float
    num_tokens: float
    """Training-rollout tokens generated up to and including this step."""


def validations(run_dir: Path) -> list[Validation]:
    """Every validation of a run from its metrics.jsonl, with the cumulative generated tokens."""
    out, num_tokens = [], 0.0
    with (run_dir / "metrics.jsonl").open() as f:
        for line in f:
            row = json.loads(line)
            num_tokens += row.get("train/num_generated_tokens", 0.0)
            if "val/acc" in row:
                out.append(Validation(row["step"], row["val/acc"], num_tokens))
    return out


def rl_seconds(run_dir: Path) -> float:
    """The RL steps' own time (the sum of timing_s/step; the warm start and the step-0 validation not included)."""
    with (run_dir / "metrics.jsonl").open() as f:
        return sum(json.loads(line).get("timing_s/step", 0.0) for line in f)


def first_reaching(vals: list[Validation], target: float) -> Validation | None:
    """The first validation at or above `target`, None if none is."""
    return next((v for v in vals if v.acc >= target), None)


def at_tokens(vals: list[Validation], num_tokens: float) -> Validation | None:
    """The last validation whose cumulative tokens are within `num_tokens` (equal-budget comparison)."""
    within = [v for v in vals if v.num_tokens <= num_tokens]
    return within[-1] if within else None


def is_complete(run_dir: Path, steps: int) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and any(json.loads(line)["step"] == steps for line in path.open())


def train(out_dir: Path, seed: int, overrides: list[str], steps: int) -> float:
    """One training run in a fresh process (skipped if already complete); returns its wall seconds (0 if skipped)."""
    if is_complete(out_dir, steps):
        return 0.0
    command = [sys.executable, "-m", "megatron_dapo.train", CONFIG, f"trainer.seed={seed}",
               f"trainer.total_training_steps={steps}", f"trainer.output_dir={out_dir}", *overrides]
    print("$", " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir.parent / f"{out_dir.name}.log").open("w") as log:
        subprocess.run(command, cwd=REPO, check=True, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    return time.perf_counter() - start


def export_teacher(run_dir: Path, hf_dir: Path) -> None:
    if (hf_dir / "config.json").exists():
        return
    command = [sys.executable, "-m", "megatron_dapo.cli", "convert", "mcore-to-hf",
               "--ckpt", str(run_dir / "checkpoints"), "--out", str(hf_dir)]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=REPO, check=True)


def fmt_reach(v: Validation | None) -> str:
    return "never" if v is None else f"step {v.step}, {v.num_tokens:,.0f} tokens"


def ratio(a: Validation | None, b: Validation | None, field: str) -> str:
    if a is None or b is None:
        return "-"
    return f"{getattr(a, field) / getattr(b, field):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/tmp/distill"))
    parser.add_argument("--seeds", default="211,212,213")
    parser.add_argument("--teacher-seed", type=int, default=42)
    parser.add_argument("--teacher-steps", type=int, default=480, help="RL steps of the teacher's run")
    parser.add_argument("--steps", type=int, default=160, help="RL steps of every compared run (the default run's)")
    parser.add_argument("--distill", nargs="*", default=DISTILL,
                        help=f"the distillation run's overrides besides its teacher (default: {' '.join(DISTILL)})")
    parser.add_argument("--margin", type=float, default=0.03, help="target = teacher accuracy - margin")
    parser.add_argument("--read", action="store_true", help="only read the runs already under --root")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    root, walls = args.root.resolve(), {}
    teacher_dir, teacher_hf = root / "teacher", root / "teacher_hf"
    if not args.read:
        walls["teacher"] = train(teacher_dir, args.teacher_seed, [], args.teacher_steps)
        export_teacher(teacher_dir, teacher_hf)
        for seed in seeds:
            walls[f"{seed}/distill"] = train(root / str(seed) / "distill", seed,
                                             [f"algorithm.distill.teacher={teacher_hf}", *args.distill], args.steps)
            walls[f"{seed}/dapo"] = train(root / str(seed) / "dapo", seed, [], args.steps)
    teacher_acc = validations(teacher_dir)[-1].acc
    target = teacher_acc - args.margin
    runs = {f"{seed}/{kind}": validations(root / str(seed) / kind) for seed in seeds for kind in ("distill", "dapo")
            if (root / str(seed) / kind / "metrics.jsonl").exists()}
    steps = sorted({v.step for vals in runs.values() for v in vals})
    print(f"\nteacher (seed {args.teacher_seed}): held-out {teacher_acc:.3f}; target {target:.3f}")
    print("| run | " + " | ".join(str(s) for s in steps) + " | RL steps s | process wall s |")
    print("|---|" + "---|" * (len(steps) + 2))
    for name, vals in runs.items():
        by_step = {v.step: f"{v.acc:.3f}" for v in vals}
        wall = f"{walls[name]:.0f}" if walls.get(name) else "-"
        rl = rl_seconds(root / name)
        print(f"| {name} | " + " | ".join(by_step.get(s, "") for s in steps) + f" | {rl:.0f} | {wall} |")
    print("\n| seed | distill: to target | final | dapo: to target | final | steps distill/dapo | "
          "tokens distill/dapo | dapo within distill's tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for seed in seeds:
        d, b = runs.get(f"{seed}/distill"), runs.get(f"{seed}/dapo")
        if not d or not b:
            continue
        rd, rb = first_reaching(d, target), first_reaching(b, target)
        eq = at_tokens(b, d[-1].num_tokens)
        equal = "-" if eq is None else f"{eq.acc:.3f} (step {eq.step}, {eq.num_tokens:,.0f} tokens)"
        print(f"| {seed} | {fmt_reach(rd)} | {d[-1].acc:.3f} | {fmt_reach(rb)} | {b[-1].acc:.3f} | "
              f"{ratio(rd, rb, 'step')} | {ratio(rd, rb, 'num_tokens')} | {equal} |")


if __name__ == "__main__":
    main()
