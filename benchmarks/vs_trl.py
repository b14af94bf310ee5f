"""The tiny DAPO step, megatron-dapo against TRL's GRPOTrainer set up as DAPO, phase by phase.

    /work/venvs/i14/bin/python benchmarks/vs_trl.py                 # 3 rounds x 12 steps, 2 threads
    python benchmarks/vs_trl.py --rounds 5 --steps 8 --baseline-path /tmp/old_checkout

TRL is an optional dependency of this benchmark only (``pip install trl``, never needed by
the trainer). Each round runs each side once in a fresh process, the order alternating
round by round, so that load from other processes falls on both sides alike (with
--baseline-path, a third side times another checkout of megatron-dapo, e.g. the commit
before a change, in the same rounds); the first
--warmup steps of each process are dropped and the tables show the median and the best
(least disturbed) RL step over all remaining steps of all rounds.

One RL step on both sides: 16 prompts x 8 responses (<= 32 response tokens, temperature 1,
top-p 1), the reward, group-normalised advantages, old log-probs with the current weights,
then 2 optimizer steps of 64 responses each with Clip-Higher 0.2/0.28, token-mean
aggregation over the optimizer step's tokens, no KL (beta 0), dynamic sampling off.

Equivalent: the weights (the SFT-warm-started scratch model of examples/tiny_cpu.yaml,
read from its HF export in the cache), the tokenizer (our sentencepiece model behind an HF
tokenizer class; the benchmark checks that both give the same prompt ids), the prompt
set, the reward (megatron_dapo.rewards.math_dapo.compute_score, no overlong shaping), the
micro-batching (one forward/backward of an optimizer step's 64 responses on each side), the
loss (TRL's "bnpo" is the token-mean over one optimizer step's tokens when
gradient_accumulation_steps=1; its "dapo" divides by half the generation batch's tokens
instead), AdamW (lr 3e-4 after 4 warm-up steps, weight decay 0.1, clip 1.0), fp32, the
thread count. Not equivalent: which prompts each step draws (each side's own shuffled
sampler), hence the responses and their lengths; TRL samples with transformers'
``generate`` (SDPA attention, its own sampler), we with rollout/local/engine.py; our actor
is megatron-core's GPTModel with DDP, the distributed-optimizer code path and a weight sync
into the engine after every step (part of our whole step, absent in TRL, which samples
with the training model itself); our reward runs in a process pool, TRL's inline.

Phases. ours: timing_s/gen, timing_s/old_log_prob, timing_s/update_actor and
timing_s/step of metrics.jsonl. TRL: transformers generate (``_generate``), the no-grad
log-prob pass of ``_generate_and_score_completions`` (old log-probs), and the update =
the two trainer steps' wall time minus ``_generate_and_score_completions``.
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
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"
PHASES = ("step", "gen", "old_log_prob", "update", "gen_tokens_per_s")
LABELS = {"step": "whole step (s)", "gen": "generation (s)", "old_log_prob": "old log-probs (s)",
          "update": "update, 2 optimizer steps (s)", "gen_tokens_per_s": "generated tokens/s during generation"}
OVERRIDES = [
    "algorithm.filter_groups.enable=false", "data.gen_batch_size=16", "data.train_batch_size=16",
    "trainer.ppo_mini_batch_size=8", "reward.overlong_buffer.enable=false", "trainer.test_freq=0",
    "trainer.val_before_train=false", "trainer.save_interval=0",
    # One forward/backward of the 64 responses per optimizer step, as TRL's
    # per_device_train_batch_size=64 does (the tiny run's 4096-token budget makes two).
    "trainer.max_tokens_per_microbatch=8192",
]


# ----------------------------------------------------------------------------- parent


def prepare(cache_dir: Path, ours_python: str, ours_path: Path, workdir: Path) -> dict[str, Any]:
    """Model, tokenizer and prompts both sides use; trains the cached SFT warm start if missing."""
    from types import SimpleNamespace

    from megatron_dapo.config.loader import load_config
    from megatron_dapo.data.datasets import load_prompt_dataset
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.embedded.warm_start import sft_cache_dir
    from megatron_dapo.run import prepare_sources, task_of

    cfg = load_config(str(CONFIG), OVERRIDES)
    task = task_of(cfg, cache_dir)
    tokenizer = load_tokenizer(task.tokenizer_path)
    sources = prepare_sources(cfg, cache_dir)  # the trainer's own paths, so the cache keys match
    single_process = SimpleNamespace(tp=1, pp=1, dp=1)  # the layout our side trains the warm start at
    sft_dir = sft_cache_dir(cfg, Path(sources["hf_dir"]), sources, single_process, cache_dir)
    if not (sft_dir / "config.json").is_file():
        print(f"training the SFT warm start into {sft_dir} (once)", flush=True)
        run_ours(ours_python, ours_path, cache_dir, workdir / "prep", steps=1, threads=2)
    records = load_prompt_dataset(str(task.train_path), tokenizer, cfg.data.max_prompt_length).records
    prompts = [{"prompt": r.prompt_text, "prompt_ids": r.prompt_ids, "ground_truth": r.ground_truth}
               for r in records]
    return {"model": str(sft_dir), "spm": str(task.tokenizer_path), "prompts": prompts,
            "seed": cfg.trainer.seed, "lr": cfg.optim.lr, "weight_decay": cfg.optim.weight_decay,
            "clip_grad": cfg.optim.clip_grad, "warmup": cfg.optim.lr_warmup_steps}


def _thread_env(threads: int) -> dict[str, str]:
    # Passive OpenMP waits: on a shared, oversubscribed machine spinning worker threads
    # made steps of either side up to 50x slower at random, which times the machine.
    return {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}


def run_ours(python: str, ours_path: Path, cache_dir: Path, out_dir: Path, *, steps: int,
             threads: int) -> list[dict[str, float]]:
    """One fresh `megatron_dapo.train` process; per-step phase seconds from its metrics.jsonl."""
    env = {**os.environ, **_thread_env(threads), "PYTHONPATH": str(ours_path),
           "MEGATRON_DAPO_CACHE": str(cache_dir)}
    cmd = [python, "-m", "megatron_dapo.train", str(CONFIG), *OVERRIDES,
           f"trainer.total_training_steps={steps}", f"trainer.output_dir={out_dir}", "logging.console=false"]
    subprocess.run(cmd, env=env, check=True, cwd=ours_path, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{"step": r["timing_s/step"], "gen": r["timing_s/gen"], "old_log_prob": r["timing_s/old_log_prob"],
             "update": r["timing_s/update_actor"], "gen_tokens_per_s": r["rollout/local0/tokens_per_s"]}
            for r in rows]


def run_trl(setup_file: Path, out_file: Path, *, steps: int, threads: int) -> list[dict[str, float]]:
    """One fresh TRL process (this script with --trl-child)."""
    env = {**os.environ, **_thread_env(threads)}
    subprocess.run([sys.executable, __file__, "--trl-child", str(setup_file), "--out", str(out_file),
                    "--steps", str(steps), "--threads", str(threads)], env=env, check=True)
    return json.loads(out_file.read_text())


def table(rows: dict[str, list[dict[str, float]]], stat: str = "median") -> str:
    """Markdown table: the median (or best) of each phase per side, and ours/TRL (and ours/baseline)."""
    pick = statistics.median if stat == "median" else min
    sides = [side for side in ("ours", "baseline", "trl") if rows.get(side)]
    names = {"ours": "megatron-dapo", "baseline": "megatron-dapo baseline", "trl": "TRL"}
    ratios = [("ours", "trl", "ours/TRL")] + ([("ours", "baseline", "ours/baseline"),
                                                ("baseline", "trl", "baseline/TRL")] if "baseline" in sides else [])
    lines = [f"| {stat} per RL step | " + " | ".join(names[s] for s in sides) + " | "
             + " | ".join(r[2] for r in ratios) + " |", "|---" * (1 + len(sides) + len(ratios)) + "|"]
    for key in PHASES:
        # The best throughput is the largest, not the smallest.
        best = max if key == "gen_tokens_per_s" and stat != "median" else pick
        med = {s: best(r[key] for r in rows[s]) for s in sides}
        fmt = "{:.0f}" if key == "gen_tokens_per_s" else "{:.3f}"
        lines.append(f"| {LABELS[key]} | " + " | ".join(fmt.format(med[s]) for s in sides) + " | "
                     + " | ".join(f"{med[a] / med[b]:.2f}" for a, b, _ in ratios) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="RL steps per process")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each process left out")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ours-path", type=Path, default=ROOT, help="checkout whose megatron_dapo is timed")
    parser.add_argument("--baseline-path", type=Path, help="another checkout timed in the same rounds")
    parser.add_argument("--ours-python", default=getattr(sys, "_base_executable", sys.executable),
                        help="interpreter for our side (default: the one this venv was made from)")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("MEGATRON_DAPO_CACHE",
                                                                          ROOT / ".cache" / "megatron-dapo")))
    parser.add_argument("--json", type=Path, help="also write every per-step row here")
    parser.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child is not None:
        trl_child(args.trl_child, args.out, steps=args.steps, threads=args.threads)
        return
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no step of --steps {args.steps} to time")
    cache = args.cache.resolve()
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        work = Path(tmp)
        setup = prepare(cache, args.ours_python, args.ours_path.resolve(), work)
        setup_file = work / "setup.json"
        setup_file.write_text(json.dumps(setup))
        rows: dict[str, list[dict[str, float]]] = {"ours": [], "trl": []}
        paths = {"ours": args.ours_path.resolve()}
        if args.baseline_path is not None:
            rows["baseline"], paths["baseline"] = [], args.baseline_path.resolve()
        sides = list(rows)
        for rnd in range(args.rounds):
            order = sides if rnd % 2 == 0 else sides[::-1]
            for side in order:
                start = time.perf_counter()
                if side == "trl":
                    got = run_trl(setup_file, work / f"trl{rnd}.json", steps=args.steps, threads=args.threads)
                else:
                    got = run_ours(args.ours_python, paths[side], cache, work / f"{side}{rnd}",
                                   steps=args.steps, threads=args.threads)
                rows[side].extend(got[args.warmup:])
                print(f"round {rnd + 1}/{args.rounds} {side}: {time.perf_counter() - start:.0f} s, median step "
                      f"{statistics.median(r['step'] for r in got[args.warmup:]):.3f} s", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\n{args.rounds} interleaved rounds x {args.steps - args.warmup} timed steps, "
          f"{args.threads} threads, ours from {args.ours_path}"
          + (f", baseline from {args.baseline_path}" if args.baseline_path else "") + "\n")
    print(table(rows))
    # On a loaded machine the best step is the least disturbed one; compare it too.
    print()
    print(table(rows, "best"))


# ----------------------------------------------------------------------------- TRL side


def _hf_tokenizer(spm_path: str) -> Any:
    """Our sentencepiece model behind transformers' Python tokenizer class (what TRL accepts)."""
    import sentencepiece as spm
    from transformers import PreTrainedTokenizer

    class SpmTokenizer(PreTrainedTokenizer):
        model_input_names: ClassVar[list[str]] = ["input_ids", "attention_mask"]

        def __init__(self, **kwargs: Any) -> None:
            self.sp = spm.SentencePieceProcessor(model_file=spm_path)
            super().__init__(eos_token=self.sp.id_to_piece(self.sp.eos_id()),
                             pad_token=self.sp.id_to_piece(self.sp.pad_id()),
                             bos_token=self.sp.id_to_piece(self.sp.bos_id()), padding_side="left", **kwargs)

        @property
        def vocab_size(self) -> int:
            return self.sp.get_piece_size()

        def get_vocab(self) -> dict[str, int]:
            return {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}

        def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
            return self.sp.encode(text, out_type=str)

        def _convert_token_to_id(self, token: str) -> int:
            return self.sp.piece_to_id(token)

        def _convert_id_to_token(self, index: int) -> str:
            return self.sp.id_to_piece(index)

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return self.sp.decode_pieces(tokens)

    return SpmTokenizer()


def trl_child(setup_file: Path, out_file: Path, *, steps: int, threads: int) -> None:
    """Train `steps` RL steps with TRL's GRPOTrainer and write per-step phase seconds."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_dapo.rewards.math_dapo import compute_score

    torch.set_num_threads(threads)
    setup = json.loads(setup_file.read_text())
    tokenizer = _hf_tokenizer(setup["spm"])
    for p in setup["prompts"][:200]:
        got = tokenizer(text=p["prompt"], add_special_tokens=False)["input_ids"]
        assert got == p["prompt_ids"], f"HF-wrapped tokenizer differs from ours on {p['prompt']!r}"
    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": p["prompt"], "ground_truth": p["ground_truth"]} for p in setup["prompts"]])

    def reward(prompts: list[str], completions: list[str], ground_truth: list[str], **_: Any) -> list[float]:
        return [float(compute_score(c, gt)["score"]) for c, gt in zip(completions, ground_truth)]

    config = GRPOConfig(
        output_dir=str(out_file.parent / "trl_out"), report_to=[], save_strategy="no", logging_steps=1,
        use_cpu=True, bf16=False, seed=setup["seed"], max_steps=2 * steps,
        per_device_train_batch_size=64, gradient_accumulation_steps=1, steps_per_generation=2,
        num_generations=8, num_iterations=1, max_completion_length=32, temperature=1.0, top_p=1.0,
        loss_type="bnpo", epsilon=0.2, epsilon_high=0.28, beta=0.0, scale_rewards="group",
        learning_rate=setup["lr"], weight_decay=setup["weight_decay"], max_grad_norm=setup["clip_grad"],
        lr_scheduler_type="constant_with_warmup", warmup_steps=setup["warmup"], gradient_checkpointing=False,
        dataloader_num_workers=0, log_completions=False, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    acc: dict[str, float] = {"gen": 0.0, "gen_tokens": 0.0, "old_log_prob": 0.0, "score": 0.0}

    def timed(name: str, fn: Any, only_no_grad: bool = False) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            if only_no_grad and torch.is_grad_enabled():
                return fn(*a, **kw)
            start = time.perf_counter()
            out = fn(*a, **kw)
            acc[name] += time.perf_counter() - start
            if name == "gen":
                acc["gen_tokens"] += sum(len(ids) for ids in out[1])  # completion_ids
            return out
        return wrapper

    trainer._generate = timed("gen", trainer._generate)
    trainer._get_per_token_logps_and_entropies = timed(
        "old_log_prob", trainer._get_per_token_logps_and_entropies, only_no_grad=True)
    trainer._generate_and_score_completions = timed("score", trainer._generate_and_score_completions)
    rows: list[dict[str, float]] = []

    class StepTimer(TrainerCallback):
        start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step % 2 == 0:
                StepTimer.start = time.perf_counter()
                acc.update(dict.fromkeys(acc, 0.0))

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step % 2 == 0:  # global_step counts the step just finished
                whole = time.perf_counter() - StepTimer.start
                rows.append({"step": whole, "gen": acc["gen"], "old_log_prob": acc["old_log_prob"],
                             "update": whole - acc["score"], "gen_tokens_per_s": acc["gen_tokens"] / acc["gen"]})

    trainer.add_callback(StepTimer())
    trainer.train()
    out_file.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
