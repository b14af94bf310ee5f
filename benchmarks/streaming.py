"""Streaming dynamic sampling against round-based, on the tiny run's own engine, data and reward.

    python benchmarks/streaming.py                         # the 60 steps of examples/tiny_cpu.yaml
    python benchmarks/streaming.py --steps 20 rollout.n=16 # any config override after the flags

Builds the run of the config (warm start from the cache, as `make run` does), then at each
RL step collects one training batch with each mode, in one process, from the same prompt
position, with the same seeds and the same weights, alternating which mode goes first, and
then trains on the streaming batch (the actor update and weight sync of the trainer), so the
policy moves through the states of a real streaming run and both modes face each of them. Prints per mode the median time to fill a
batch (timing_s/fill: from the first request until train_batch_size kept groups are scored;
the round-based path's whole collection), the median CPU seconds of the process over the
collection (robust to load from other processes), generated tokens per kept group (aborted
and dropped tokens included) and prompts used, then the ratio streaming / rounds.
A third mode, streaming with partial rollouts, carries what its abort cut short into its
own next step (off-policy tokens: opt-in). Every mode keeps exactly train_batch_size groups
with 0 < acc < 1; the script asserts it.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import replace

from megatron_dapo import parallel
from megatron_dapo.collect import collect_batch
from megatron_dapo.config.loader import load_config
from megatron_dapo.errors import quiet_optional_backend_warnings
from megatron_dapo.metrics import Timer
from megatron_dapo.run import build_run
from megatron_dapo.trainer import update_policy

MODES = ("rounds", "streaming", "partial")
"""partial = streaming with rollout.partial_rollout (its carry kept from its own previous step)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/tiny_cpu.yaml")
    parser.add_argument("--steps", type=int, default=60, help="RL steps (batches collected per mode)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    quiet_optional_backend_warnings()
    cfg = load_config(args.config, ["trainer.resume=disable", "logging.console=false", *args.overrides])
    run = build_run(cfg, args.config)
    try:
        results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        forwards: list[int] = []
        engine_model = getattr(run.rollout.engines[0], "model", None)
        if engine_model is not None:  # the local engine: count its forwards and their rows
            engine_model.register_forward_hook(lambda module, args, out: forwards.append(out.logits.shape[0]))
        partial_carry: list = []
        for step in range(1, args.steps + 1):
            start_state = run.sampler.state_dict()
            order = MODES if step % 2 else MODES[::-1]
            batches, end_states = {}, {}
            for mode in order:
                run.sampler.load_state_dict(start_state)
                settings = replace(run.collect_settings, streaming=mode != "rounds", partial_rollout=mode == "partial")
                forwards.clear()
                cpu = time.process_time()
                # Every mode starts from the streaming run's keep rate; partial also from its own carry.
                state = replace(run.collect_state, carried=partial_carry if mode == "partial" else [])
                groups, metrics = collect_batch(run.sampler, step, rollout=run.rollout, rewards=run.rewards,
                                                tokenizer=run.tokenizer, settings=settings, state=state)
                cpu = time.process_time() - cpu
                accs = [sum(s.acc for s in g.samples) / len(g.samples) for g in groups]
                assert len(groups) == settings.train_batch_size and all(0 < a < 1 for a in accs), (mode, accs)
                results[mode].append({
                    "fill_s": metrics["timing_s/fill"], "cpu_s": cpu,
                    "tokens_per_group": metrics["rollout/generated_tokens_per_kept_group"],
                    "prompts": metrics["train/num_gen_batches"] * settings.gen_batch_size,
                    "aborted": metrics["rollout/aborted_tokens"],
                    "forwards": len(forwards), "rows": sum(forwards),
                })
                batches[mode], end_states[mode] = groups, (run.sampler.state_dict(), state)
                if mode == "partial":
                    partial_carry = state.carried
            run.sampler.load_state_dict(end_states["streaming"][0])
            run.collect_state = end_states["streaming"][1]
            update_policy(run, batches["streaming"], Timer(), version=step)
    finally:
        run.close()
        parallel.destroy()
    print(f"{args.steps} batches per mode, train_batch_size {cfg.data.train_batch_size} x n {cfg.rollout.n}, "
          f"gen_batch_size {cfg.data.gen_batch_size}, medians over batches")
    keys = [("fill_s", "time to fill (s)"), ("cpu_s", "process CPU s per batch"),
            ("tokens_per_group", "generated tokens per kept group"), ("prompts", "prompts used per batch"),
            ("aborted", "aborted tokens per batch"), ("forwards", "engine forwards per batch (local engine)"),
            ("rows", "engine rows computed per batch (local engine)")]
    print("| median | rounds | streaming | streaming + partial | streaming / rounds | partial / rounds |")
    print("|---|---|---|---|---|---|")
    for key, label in keys:
        r, s, p = (statistics.median(x[key] for x in results[mode]) for mode in MODES)
        ratios = " | ".join(f"{v / r:.2f}" if r else "-" for v in (s, p))
        print(f"| {label} | {r:.3f} | {s:.3f} | {p:.3f} | {ratios} |")
    mean_r, mean_s, mean_p = (statistics.mean(x["fill_s"] for x in results[mode]) for mode in MODES)
    print(f"mean time to fill: rounds {mean_r:.3f} s, streaming {mean_s:.3f} s ({mean_s / mean_r:.2f}), "
          f"streaming + partial {mean_p:.3f} s ({mean_p / mean_r:.2f})")


if __name__ == "__main__":
    main()
