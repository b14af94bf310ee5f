"""`megatron-dapo eval CHECKPOINT --data FILE`: score any checkpoint on a prompt dataset.

The checkpoint is an HF directory or a torch_dist training/converted checkpoint (a
``step_<N>`` directory, a checkpoints root or its ``latest`` pointer; any TP/PP layout it
was saved at: it is exported to a temporary HF directory at TP=1, PP=1 first). Responses
come from the configured rollout engine (``local`` on CPU, ``sglang`` on a GPU) and are
scored by the configured reward function, exactly as the trainer's validation does:

- settings default to the training config stored in the checkpoint (rollout.val_kwargs,
  data.max_response_length / max_prompt_length, reward.*, and the validation seed
  trainer.seed + 2), so the accuracy reported for the last checkpoint of a run equals the
  trainer's last ``val/acc``; without a stored config (an HF directory, unless --config is
  given) the paper's AIME evaluation is the default: avg@32, temperature 1.0, top_p 0.7;
- prompts are generated in batches of whole 64-row engine chunks with the global prompt
  index as the seed offset, the same chunks and seeds as the trainer's single call.

Every response is appended to a JSONL file with its score as soon as its batch is scored;
a rerun with the same settings skips the prompts already there (resume after a kill), and
one with different settings refuses the file. Metrics: avg@n (mean accuracy over all
responses, the paper's AIME metric), unbiased pass@k (Chen et al. 2021, "Evaluating Large
Language Models Trained on Code", eq. 1; verl's estimator), mean response length and the
truncation rate, overall and per data source.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megatron_dapo.config import ENGINE_NAMES, Config
from megatron_dapo.errors import UserError

# The local engine decodes this many rows together (run.py builds it with the default);
# batches of whole chunks make every row see the batch the trainer's validation gave it.
ENGINE_ROWS_PER_CHUNK = 64
PAPER_EVAL_N = 32
MAX_EVAL_N = 1024
"""The most responses per prompt one `eval` draws (an unbounded --n ran for hours unannounced)."""


@dataclass(kw_only=True, slots=True)
class EvalSettings:
    """How responses are sampled and scored; stored (as a digest) in every JSONL row."""

    n: int
    """Responses per prompt (k of avg@k)."""
    temperature: float
    """Sampling temperature."""
    top_p: float
    """Nucleus sampling mass; 1 = off."""
    top_k: int
    """Top-k sampling; -1 = off."""
    max_new_tokens: int
    """Response length limit; a response that reaches it counts as truncated."""
    max_prompt_length: int
    """Prompts with more tokens are dropped (as in training)."""
    seed: int
    """Base sampling seed; the trainer's validation uses trainer.seed + 2."""
    reward_fn: str
    """Reward function (reward.reward_fn)."""
    tools: dict[str, Any] | None = None
    """The tools section (asdict of ToolsConfig) when responses are episodes with tool calls, as in
    training; None = one turn."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise UserError(f"--n {self.n}: need at least one response per prompt")
        if self.n > MAX_EVAL_N:
            raise UserError(f"--n {self.n}: at most {MAX_EVAL_N} responses per prompt (avg@32 is the paper's; "
                            f"pass@k needs n >= k only); split a larger evaluation into runs with other --seed")
        if not 0 < self.top_p <= 1:  # NaN fails every comparison: written as what holds, negated
            raise UserError(f"--top-p {self.top_p}: must be in (0, 1]")
        if not 0 <= self.temperature < math.inf:
            raise UserError(f"--temperature {self.temperature}: must be a finite number >= 0 (0 = greedy)")
        if self.top_k != -1 and self.top_k < 1:
            raise UserError(f"--top-k {self.top_k}: must be -1 (off) or >= 1")
        if self.max_new_tokens < 1 or self.max_prompt_length < 1:
            raise UserError("--max-new-tokens and --max-prompt-length must be >= 1")

    def fingerprint(self, model: str, data: Sequence[str]) -> str:
        from megatron_dapo.embedded import digest

        return digest({"settings": asdict(self), "model": model, "data": list(data)})


# ---------------------------------------------------------------------------- metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Args:
        n: samples drawn for the problem.
        c: correct samples among them.
        k: the k of pass@k (<= n).

    Returns:
        The probability that at least one of k samples drawn without replacement is correct.
    """
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # The product form of the ratio avoids huge binomials (n = 32 .. 1024).
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n itself."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) < n]
    return [*ks, n]


def summarize(rows: Sequence[dict[str, Any]], n: int, ks: Sequence[int]) -> dict[str, dict[str, float]]:
    """avg@n, pass@k, mean score, mean response length and truncation rate, overall and per data source.

    Args:
        rows: response rows (keys index, data_source, acc, score, response_length, finish_reason).
        n: responses per prompt.
        ks: the k values of pass@k.

    Returns:
        {"all": metrics, <data_source>: metrics, ...}; metrics keys: num_prompts, avg@n,
        pass@k..., score/mean, response_length/mean, truncation_rate.
    """
    from megatron_dapo.tools.episode import episode_rows_metrics

    by_source: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        by_source["all"][row["index"]].append(row)
        by_source[row["data_source"]][row["index"]].append(row)
    out: dict[str, dict[str, float]] = {}
    for source, prompts in by_source.items():
        responses = [r for group in prompts.values() for r in group]
        metrics = {"num_prompts": float(len(prompts)),
                   f"avg@{n}": sum(bool(r["acc"]) for r in responses) / len(responses)}
        for k in ks:
            metrics[f"pass@{k}"] = sum(pass_at_k(len(g), sum(bool(r["acc"]) for r in g), k)
                                       for g in prompts.values()) / len(prompts)
        metrics["score/mean"] = sum(float(r["score"]) for r in responses) / len(responses)
        metrics["response_length/mean"] = sum(r["response_length"] for r in responses) / len(responses)
        metrics["truncation_rate"] = sum(r["finish_reason"] == "length" for r in responses) / len(responses)
        metrics.update(episode_rows_metrics([r["episode"] for r in responses if r.get("episode")]))
        out[source] = metrics
    return out


def format_summary(summary: dict[str, dict[str, float]], n: int, ks: Sequence[int]) -> str:
    """A table: one line per data source ("all" first)."""
    cols = [f"avg@{n}", *[f"pass@{k}" for k in ks], "response_length/mean", "truncation_rate"]
    names = ["all", *sorted(s for s in summary if s != "all")]
    width = max(len(s) for s in names)
    header = f"{'data_source':<{width}}  prompts  " + "  ".join(f"{c.replace('/mean', ''):>10}" for c in cols)
    lines = [header]
    for s in names:
        m = summary[s]
        lines.append(f"{s:<{width}}  {int(m['num_prompts']):7d}  " + "  ".join(f"{m[c]:10.4f}" for c in cols))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- checkpoint


def is_hf_dir(path: Path) -> bool:
    """Whether `path` is an HF model directory (config.json and safetensors weights)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_training_checkpoint(path: Path) -> Path | None:
    """A torch_dist checkpoint directory for a step dir, a checkpoints root or its ``latest`` file."""
    from megatron_dapo.checkpoint import MANIFEST, latest_checkpoint

    if path.is_file() and path.name == "latest":
        return latest_checkpoint(path.parent)
    if (path / MANIFEST).is_file():
        return path
    if path.is_dir():
        return latest_checkpoint(path)
    return None


def stored_config(ckpt: Path | None) -> Config | None:
    """The training config a torch_dist checkpoint carries, or None."""
    from megatron_dapo.checkpoint import CONFIG_YAML

    if ckpt is None or not (ckpt / CONFIG_YAML).is_file():
        return None
    from megatron_dapo.config.loader import from_dict, read_config_tree

    # The loader's bounds (size, depth, aliases, UTF-8): the stored file is as hostile as any config.
    return from_dict(read_config_tree(ckpt / CONFIG_YAML), source=str(ckpt / CONFIG_YAML))


def export_to_hf(ckpt: Path, out: Path) -> Path:
    """Export a torch_dist checkpoint (any saved layout) to an HF directory (TP=1, PP=1).

    The export streams on megatron-core's CPU layer, which cannot share a process with a live CUDA
    runtime (device.hide_gpus_for_cpu_work): where CUDA is visible it runs as `megatron-dapo convert mcore-to-hf`
    in a child that sees no GPU, and this process keeps the GPU for the engine; elsewhere in this
    process (no second interpreter to start).
    """
    import torch

    if torch.cuda.is_available():
        return _export_in_a_cpu_child(ckpt, out)
    from megatron_dapo import parallel
    from megatron_dapo.convert import mcore_to_hf

    try:
        return mcore_to_hf(str(ckpt), str(out), device="auto")
    finally:
        parallel.destroy()


def _export_in_a_cpu_child(ckpt: Path, out: Path) -> Path:
    import subprocess

    from megatron_dapo.rollout.server_process import server_environment

    # One process of its own (no launcher variables), no GPU.
    env = {**server_environment(), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "convert", "mcore-to-hf", "--ckpt", str(ckpt),
                           "--out", str(out)], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    lines = done.stderr.strip().splitlines() or ["no output"]
    if done.returncode == 2 and lines[-1].startswith("error: "):
        raise UserError(lines[-1].removeprefix("error: "))
    if done.returncode != 0:
        raise RuntimeError(f"exporting {ckpt} to {out} in a CPU process failed (exit {done.returncode}):\n"
                           + "\n".join(lines[-20:]))
    return out


# ---------------------------------------------------------------------------- responses file


def read_done(path: Path, fingerprint: str, n: int) -> list[dict[str, Any]]:
    """Complete prompts (all n responses) already in the responses file, with these settings.

    A line cut off by a kill is dropped (the file is truncated to its last complete line).

    Raises:
        UserError: the file was written with other settings, model or data.
    """
    if not path.is_file():
        return []
    rows: list[dict[str, Any]] = []
    good_bytes = 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                row = json.loads(raw)
            except (ValueError, RecursionError):
                break
            if not raw.endswith(b"\n"):
                break
            if row.get("settings") != fingerprint:
                raise UserError(f"{path} line {line_no} was written with other settings, model or data "
                                f"(fingerprint {row.get('settings')} != {fingerprint}); pass another --out "
                                "or delete the file to start over")
            rows.append(row)
            good_bytes += len(raw)
    if good_bytes != path.stat().st_size:
        with path.open("r+b") as f:
            f.truncate(good_bytes)
    counts: dict[int, int] = defaultdict(int)
    for row in rows:
        counts[row["index"]] += 1
    return [r for r in rows if counts[r["index"]] == n]


def batches(num_prompts: int, n: int) -> Iterator[range]:
    """Prompt ranges whose rows fill whole engine chunks (the last may be shorter)."""
    per_batch = ENGINE_ROWS_PER_CHUNK // math.gcd(ENGINE_ROWS_PER_CHUNK, n)
    for start in range(0, num_prompts, per_batch):
        yield range(start, min(start + per_batch, num_prompts))


# ---------------------------------------------------------------------------- the run


@dataclass(kw_only=True, slots=True)
class EvalResult:
    summary: dict[str, dict[str, float]]
    """summarize() of all rows."""
    responses_path: Path
    """The JSONL of every response."""
    num_generated_prompts: int
    """Prompts generated by this call (the rest came from the file)."""


def evaluate_checkpoint(
    checkpoint: str,
    data_files: Sequence[str],
    settings: EvalSettings,
    *,
    out: Path,
    tokenizer_path: str,
    engine: str = "local",
    reward_num_workers: int = 2,
    reward_timeout_s: float = 10.0,
    engine_tp: int = 1,
    gpu_memory_utilization: float = 0.7,
    ks: Sequence[int] | None = None,
    progress: bool = True,
) -> EvalResult:
    """Generate, score and summarize; resumes from ``out`` when it holds rows of these settings.

    Args:
        checkpoint: an HF directory or a torch_dist checkpoint (step dir, root or ``latest``).
        data_files: prompt files (jsonl/parquet, the trainer's schemas), concatenated in order.
        settings: sampling and scoring settings.
        out: the responses JSONL.
        tokenizer_path: sentencepiece .model or HF tokenizer directory.
        engine: an engine family (rollout/factory.py): "local" (in-process), "sglang" or "vllm" (a
            server launched on this node, its log beside ``out``).
        ks: pass@k values; default 1, 2, 4, ... and n.

    Returns:
        The summary, the responses file and how many prompts were generated now.
    """
    from megatron_dapo.data.datasets import load_prompt_dataset
    from megatron_dapo.data.tokenizer import load_tokenizer

    ks = list(ks or default_ks(settings.n))
    if any(not 0 < k <= settings.n for k in ks):
        raise UserError(f"--pass-k {ks}: every k must be in 1..n={settings.n}")
    tokenizer = load_tokenizer(tokenizer_path)
    records = [r for f in data_files
               for r in load_prompt_dataset(f, tokenizer, settings.max_prompt_length, where_set="--data").records]
    ckpt_path = Path(checkpoint)
    fingerprint = settings.fingerprint(str(ckpt_path.resolve()), [str(Path(f).resolve()) for f in data_files])
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = read_done(out, fingerprint, settings.n)
    done = {r["index"] for r in rows}
    todo = [b for b in batches(len(records), settings.n) if any(i not in done for i in b)]
    num_generated = 0
    if todo:
        with tempfile.TemporaryDirectory(prefix=".eval-hf-", dir=out.parent) as tmp:
            hf_dir = ckpt_path
            if not is_hf_dir(ckpt_path):
                found = resolve_training_checkpoint(ckpt_path)
                if found is None:
                    raise UserError(f"{checkpoint} is neither an HF directory (config.json + *.safetensors) "
                                    "nor a torch_dist checkpoint (step_<N>/, checkpoints/ or checkpoints/latest)")
                hf_dir = export_to_hf(found, Path(tmp) / "hf")
            from megatron_dapo.config.preflight import check_tokenizer_fits

            check_tokenizer_fits(tokenizer, hf_dir, f"tokenizer {tokenizer_path}")  # else the engine's traceback
            with open(out, "a", encoding="utf-8") as sink:
                num_generated = _generate(records, todo, done, settings, hf_dir=hf_dir, tokenizer=tokenizer,
                                          engine=engine, engine_tp=engine_tp,
                                          gpu_memory_utilization=gpu_memory_utilization, log_dir=out.parent,
                                          reward_num_workers=reward_num_workers, reward_timeout_s=reward_timeout_s,
                                          fingerprint=fingerprint, sink=sink, rows=rows, progress=progress)
    return EvalResult(summary=summarize(rows, settings.n, ks), responses_path=out, num_generated_prompts=num_generated)


def _generate(records: Sequence[Any], todo: Sequence[range], done: set[int], settings: EvalSettings, *,
              hf_dir: Path, tokenizer: Any, engine: str, engine_tp: int, gpu_memory_utilization: float,
              log_dir: Path, reward_num_workers: int, reward_timeout_s: float, fingerprint: str, sink: Any,
              rows: list[dict[str, Any]], progress: bool) -> int:
    """Generate and score the missing prompts batch by batch, appending to ``sink`` and ``rows``."""
    from megatron_dapo.metrics import format_duration, progress_bar
    from megatron_dapo.rewards.pool import RewardPool
    from megatron_dapo.rollout.engine import SamplingParams
    from megatron_dapo.rollout.factory import EvalEngineArgs, eval_engine

    params = SamplingParams(n=settings.n, temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                            max_new_tokens=settings.max_new_tokens, stop_token_ids=(tokenizer.eos_id,),
                            seed=settings.seed)
    from megatron_dapo.tools.episode import episode_row

    # Before the engine: a custom tool that does not load fails in seconds, with no server to stop.
    runner = None
    if settings.tools is not None:
        from megatron_dapo.config.tools import PythonToolConfig, ToolsConfig
        from megatron_dapo.tools.registry import episode_runner

        tools = ToolsConfig(**{**settings.tools, "python": PythonToolConfig(**settings.tools["python"])})
        runner = episode_runner(tools, tokenizer, settings.max_new_tokens, log_dir=log_dir)
    try:
        gen = eval_engine(engine, EvalEngineArgs(hf_dir=hf_dir, vocab_size=tokenizer.vocab_size,
                                                 max_batch_size=ENGINE_ROWS_PER_CHUNK, tensor_parallel_size=engine_tp,
                                                 gpu_memory_utilization=gpu_memory_utilization, log_dir=log_dir))
    except BaseException:
        if runner is not None:
            runner.close()
        raise
    total = sum(i not in done for b in todo for i in b)
    num_done, start = 0, time.perf_counter()
    try:
        with RewardPool(settings.reward_fn, reward_num_workers, reward_timeout_s) as pool:
            for batch in todo:
                # Done prompts of a partly written batch are generated again but not rewritten:
                # the engine's chunk, and so every row's numerics, stay those of the trainer.
                prompts = [records[i].prompt_ids for i in batch]
                if runner is None:
                    results = gen.generate(prompts, params, index_offset=batch.start)
                else:
                    results = [dataclasses.replace(r, prompt_index=r.prompt_index + batch.start)
                               for r in runner.generate(_relative(gen, batch.start), prompts, params)]
                texts = [tokenizer.decode(r.output_ids) for r in results]
                scored, _ = pool.score_batch([(t, records[r.prompt_index].ground_truth,
                                               records[r.prompt_index].extra_info or None,
                                               records[r.prompt_index].data_source)
                                              for r, t in zip(results, texts)])
                for r, text, s in zip(results, texts, scored):
                    if r.prompt_index in done:
                        continue
                    rec = records[r.prompt_index]
                    row = {"index": r.prompt_index, "sample": r.sample_index, "row": rec.index,
                           "data_source": rec.data_source, "prompt": rec.prompt_text, "response": text,
                           "ground_truth": rec.ground_truth, "score": float(s["score"]), "acc": bool(s["acc"]),
                           "response_length": len(r.output_ids), "finish_reason": r.finish_reason,
                           "settings": fingerprint}
                    if r.episode is not None:  # every turn: the segments as text, and each call
                        row["episode"] = episode_row(r, tokenizer)
                    sink.write(json.dumps(row) + "\n")
                    rows.append(row)
                sink.flush()
                os.fsync(sink.fileno())
                num_done += sum(i not in done for i in batch)
                if progress:
                    elapsed = time.perf_counter() - start
                    eta = elapsed / num_done * (total - num_done)
                    print(f"\reval {progress_bar(num_done, total)} {num_done}/{total} prompts "
                          f"{format_duration(elapsed)} elapsed, ~{format_duration(eta)} left", end="",
                          file=sys.stderr, flush=True)
    finally:
        gen.shutdown()
        if runner is not None:
            runner.close()
        if progress:
            print(file=sys.stderr)
    return total


def _relative(gen: Any, offset: int) -> Any:
    """The engine's generate with the batch's global indices (seeds) and results indexed from 0."""
    def generate(prompts: Sequence[Sequence[int]], params: Any) -> list[Any]:
        return [dataclasses.replace(r, prompt_index=r.prompt_index - offset)
                for r in gen.generate(prompts, params, index_offset=offset)]

    return generate



# ---------------------------------------------------------------------------- command line


def add_eval_arguments(parser: Any) -> None:
    """The arguments of `megatron-dapo eval`."""
    parser.add_argument("checkpoint", help="HF directory, or a torch_dist checkpoint: step_<N>/, checkpoints/ "
                        "or checkpoints/latest (any saved TP/PP layout)")
    parser.add_argument("--data", action="append", required=True, metavar="FILE",
                        help="prompt file (jsonl/parquet, DAPO-Math-17K or plain schema); repeat for several")
    parser.add_argument("--n", type=int, help="responses per prompt (default: the run's rollout.val_kwargs.n; "
                        f"{PAPER_EVAL_N} without a training config)")
    parser.add_argument("--temperature", type=float, help="default: rollout.val_kwargs.temperature (1.0)")
    parser.add_argument("--top-p", type=float, help="default: rollout.val_kwargs.top_p (0.7)")
    parser.add_argument("--top-k", type=int, help="default: rollout.val_kwargs.top_k (-1, off)")
    parser.add_argument("--max-new-tokens", type=int, help="default: data.max_response_length")
    parser.add_argument("--max-prompt-length", type=int, help="default: data.max_prompt_length")
    parser.add_argument("--seed", type=int, help="sampling seed (default: trainer.seed + 2, the validation seed)")
    parser.add_argument("--pass-k", type=lambda s: [int(k) for k in s.split(",")], default=None,
                        help="comma-separated k of pass@k (default 1,2,4,...,n)")
    parser.add_argument("--config", help="experiment YAML whose settings to use (default: the one stored in "
                        "a training checkpoint; DAPO's defaults for an HF directory)")
    parser.add_argument("--tokenizer", help="sentencepiece .model or HF tokenizer directory (default: the "
                        "config's, the embedded task's, or the checkpoint's own files)")
    parser.add_argument("--engine", choices=ENGINE_NAMES, help="rollout engine (default: rollout.engine)")
    parser.add_argument("--out", type=Path, help="responses JSONL (default eval/<checkpoint>_<data>_n<k>.jsonl); "
                        "a rerun with the same settings resumes it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_eval(args: Any) -> int:
    """`megatron-dapo eval`: resolve settings, evaluate, print the table, write the summary JSON."""
    from megatron_dapo.checkpoint import DIST_DIR, read_manifest
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.rollout.factory import check_installed

    ckpt = Path(args.checkpoint)
    if not ckpt.exists():
        raise UserError(f"checkpoint {ckpt} does not exist; pass an HF directory or runs/<name>/checkpoints/latest")
    training = None if is_hf_dir(ckpt) else resolve_training_checkpoint(ckpt)
    if not is_hf_dir(ckpt) and training is None and (ckpt / DIST_DIR).is_dir():
        read_manifest(ckpt)  # a half-written save: the converter's words for it
    if not is_hf_dir(ckpt) and training is None:
        raise UserError(f"{ckpt} is neither an HF directory (config.json + *.safetensors) nor a torch_dist "
                        "checkpoint (step_<N>/, checkpoints/ or checkpoints/latest)")
    if training is None:
        # The checks train and convert run on an HF checkpoint (config.json's family and MoE shape,
        # every tensor's name, shape and dtype against it, truncated shards), before any engine:
        # transformers loaded a config of 8 experts over tensors for 6 with two random experts.
        from megatron_dapo.config.preflight import check_hf_checkpoint

        check_hf_checkpoint(ckpt, where="checkpoint")
    from megatron_dapo.collect.heldout import VAL_SEED_OFFSET

    cfg = load_config(args.config) if args.config else stored_config(training)
    v = (cfg or Config()).rollout.val_kwargs
    base = cfg or Config()

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    settings = EvalSettings(
        n=pick(args.n, v.n if cfg is not None else PAPER_EVAL_N), temperature=pick(args.temperature, v.temperature),
        top_p=pick(args.top_p, v.top_p), top_k=pick(args.top_k, v.top_k),
        max_new_tokens=pick(args.max_new_tokens, base.data.max_response_length),
        max_prompt_length=pick(args.max_prompt_length, base.data.max_prompt_length),
        seed=pick(args.seed, base.trainer.seed + VAL_SEED_OFFSET), reward_fn=base.reward.reward_fn,
        tools=asdict(base.tools) if base.tools.enable else None)
    out = args.out or Path("eval") / f"{(training or ckpt).name}_{Path(args.data[0]).stem}_n{settings.n}.jsonl"
    _check_out(out)
    check_installed(args.engine or base.rollout.engine, base.rollout, where="--engine" if args.engine else "rollout.engine")
    result = evaluate_checkpoint(
        str(training or ckpt), args.data, settings, out=out, tokenizer_path=_tokenizer_for(args.tokenizer, cfg, ckpt, training),
        engine=args.engine or base.rollout.engine, reward_num_workers=base.reward.num_workers,
        reward_timeout_s=base.reward.timeout_s, engine_tp=base.rollout.tensor_model_parallel_size,
        gpu_memory_utilization=base.rollout.gpu_memory_utilization, ks=args.pass_k, progress=not args.no_progress)
    ks = list(args.pass_k or default_ks(settings.n))
    print(f"{training or ckpt} on {', '.join(args.data)}: n={settings.n} temperature={settings.temperature} "
          f"top_p={settings.top_p} max_new_tokens={settings.max_new_tokens} seed={settings.seed}")
    print(format_summary(result.summary, settings.n, ks))
    summary_path = out.with_suffix(".summary.json")
    summary_path.write_text(json.dumps({"checkpoint": str(training or ckpt), "data": args.data,
                                        "settings": asdict(settings), "metrics": result.summary}, indent=2) + "\n")
    print(f"responses: {out} ({result.num_generated_prompts} prompts generated now); summary: {summary_path}")
    return 0


def _check_out(out: Path) -> None:
    """--out must be a file this process can create or append to (checked before any work)."""
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; pass a file path such as {out / 'responses.jsonl'}")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"--out {out} cannot be created: {parent} is a file; pass another --out")
    target = out if out.exists() else parent
    if not os.access(target, os.W_OK):
        raise UserError(f"--out {out} is not writable ({target}); pass another --out")


def _tokenizer_for(explicit: str | None, cfg: Any, ckpt: Path, training: Path | None) -> str:
    """--tokenizer, the config's, the embedded task's (cached), or the checkpoint's own files."""
    if explicit:
        return explicit
    if cfg is not None and cfg.model.tokenizer:
        return cfg.model.tokenizer
    if cfg is not None and cfg.model.hf_checkpoint is None:
        from megatron_dapo.embedded import cache_root, task_of

        return str(task_of(cfg, cache_root()).tokenizer_path)
    if training is not None:
        from megatron_dapo.checkpoint import hf_files_of

        hf = hf_files_of(training)
        if hf is None:
            raise UserError(f"checkpoint {training} carries no tokenizer files; pass --tokenizer")
        return str(hf)
    return str(ckpt)
