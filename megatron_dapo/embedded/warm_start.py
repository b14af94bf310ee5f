"""SFT warm start of the embedded run's scratch model, with the Megatron actor itself.

RL cannot start from a policy that never produces "Answer: <n>": every group would be
all-wrong and dynamic sampling would drop them all. A few hundred supervised steps on
worked solutions bring the tiny model to a starting accuracy between about 10% and 50%.

No separate SFT code path: with advantage 1 on every response token and old log-probs
equal to the current ones, the ratio is exactly 1, no clip is active, and the DAPO
token-mean loss has exactly the gradient of the token-mean negative log-likelihood. So
SFT runs through the same actor, micro-batching and optimizer as RL (any TP/PP/DP).

With a target band (model.sft_warm_start.target_acc_min/max) SFT stops at the first check
whose held-out accuracy, measured as the trainer's val/acc (its own draw), lies in the band: the
same SFT steps land at different accuracies on different CPUs (float results differ by
instruction set and are amplified over hundreds of steps at a high lr, DESIGN.md), and a
band gives every machine a comparable starting policy instead of the same step count.

The result is exported as an HF checkpoint and cached, keyed by everything it depends on:
the scratch checkpoint, every SFT and band setting, the corpus and tokenizer, the seed,
the layout and micro-batching (they change float summation order), the library versions
and the CPU's kernel level (embedded.environment_key). The RL actor and the engines load it
like any other HF checkpoint; `warm_start.json` beside it records the checks.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_dapo import parallel
from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.actor.build import build_actor
from megatron_dapo.actor.microbatch import RolloutBatch, balance_across_dp
from megatron_dapo.algo import LossSettings
from megatron_dapo.checkpoint.files import chmod_as_created
from megatron_dapo.config import Config, OptimConfig
from megatron_dapo.data.arithmetic import CALC_MARKERS
from megatron_dapo.data.tokenizer import load_tokenizer
from megatron_dapo.embedded import atomic_dir, digest, environment_key
from megatron_dapo.errors import UserError
from megatron_dapo.models import DecoderAdapter

logger = logging.getLogger(__name__)


# Bumped when the SFT recipe in this module changes, so entries cached by older code are not reused.
WARM_START_VERSION = 2
WARM_START_RECORD = "warm_start.json"


def sft_cache_key(cfg: Config, init_dir: Path, sources: dict[str, Any], dims: parallel.ParallelDims) -> dict[str, Any]:
    """Every input of the warm-started checkpoint (see the module docstring)."""
    s = cfg.model.sft_warm_start
    sft = asdict(s)
    if not s.band_by_kind:  # only when on, so the warm starts cached before it stay valid
        del sft["band_by_kind"]
    key: dict[str, Any] = {
        "version": WARM_START_VERSION, "init": init_dir.name, "sft": sft, "clip_grad": cfg.optim.clip_grad,
        "corpus": sources["sft_path"], "tokenizer": sources["tokenizer"], "seed": cfg.trainer.seed,
        "dtype": cfg.model.dtype, "layout": [dims.tp, dims.pp, dims.dp],
        "max_tokens_per_microbatch": cfg.trainer.max_tokens_per_microbatch, "environment": environment_key(),
    }
    if s.band is not None:
        key["check"] = {"val": cfg.data.val_files or [sources["val"]], "val_kwargs": asdict(cfg.rollout.val_kwargs),
                        "max_prompt_length": cfg.data.max_prompt_length,
                        "max_response_length": cfg.data.max_response_length, "reward_fn": cfg.reward.reward_fn}
        if cfg.tools.enable:  # the checks run episodes with the tools: another band's stopping point
            key["check"]["tools"] = asdict(cfg.tools)
    return key


def sft_cache_dir(cfg: Config, init_dir: Path, sources: dict[str, Any], dims: parallel.ParallelDims,
                  cache_dir: Path) -> Path:
    """Where the warm-started checkpoint of these settings is cached."""
    return cache_dir / f"sft-{digest(sft_cache_key(cfg, init_dir, sources, dims))}"


class AccuracyBand:
    """Held-out accuracy checks during SFT; keeps the weights of the check nearest the band.

    Called collectively every `check_interval` steps: the actor's weights are exported as HF
    tensors (every rank takes part), the controller loads them into its engine and scores
    the held-out prompts as the trainer's validation does; every rank gets the decision.
    """

    def __init__(self, adapter: DecoderAdapter, dims: parallel.ParallelDims, band: tuple[float, float],
                 evaluate: Callable[[list[tuple[str, torch.Tensor]]], float] | None,
                 reading: str = "acc") -> None:
        """Args:
            adapter: exports the actor's weights.
            dims: the layout.
            band: (min, max) held-out accuracy.
            evaluate: controller only: HF tensors -> the accuracy the band reads; None on other ranks.
            reading: what `evaluate` returns, for the log ("acc", or the weakest kind's).
        """
        self.adapter, self.dims, self.band, self.evaluate, self.reading = adapter, dims, band, evaluate, reading
        self.checks: list[dict[str, float]] = []
        self.best: dict[str, torch.Tensor] | None = None
        self.best_step = 0
        self.near = False
        """The last check read at least half of the band's lower end (the same on every rank)."""

    def distance(self, acc: float) -> float:
        low, high = self.band
        return max(low - acc, acc - high, 0.0)

    def __call__(self, model: Any, step: int) -> bool:
        """Check after `step`; True (on every rank) when SFT should stop. Sets `near` on every rank."""
        tensors = [(name, t.detach().to("cpu").contiguous().clone()) for name, t in self.adapter.export_hf(
            model, self.dims, receivers="controller")]
        decision = None
        if self.evaluate is not None:
            acc = self.evaluate(tensors)
            logger.info("sft warm start step %d: held-out %s %.4f (target band [%.2f, %.2f])", step, self.reading, acc,
                        *self.band)
            if not self.checks or self.distance(acc) < min(self.distance(c["acc"]) for c in self.checks):
                self.best, self.best_step = dict(tensors), step
            self.checks.append({"step": step, "acc": acc})
            # Above the band is a stop too: more steps only climb further from it.
            decision = (acc >= self.band[0], acc >= self.band[0] / 2)
        box = [decision]
        dist.broadcast_object_list(box, src=0)
        stop, self.near = box[0]
        return bool(stop)


def warm_start(cfg: Config, actor: MegatronActor, control: parallel.ControlGroups, adapter: DecoderAdapter,
               init_dir: Path, sources: dict[str, Any], out: Path) -> None:
    """SFT the scratch model (fixed steps, or until the held-out band) and write it to `out` (collective)."""
    s = cfg.model.sft_warm_start
    dims = actor.dims
    if s.band is None:
        run_sft(actor, control, sources["sft_path"], sources["tokenizer"], num_steps=s.num_steps,
                batch_size=s.batch_size, seed=cfg.trainer.seed)
        export_hf_checkpoint(adapter, actor.model, dims, init_dir, out)
        return
    closers: list[Callable[[], None]] = []
    try:
        evaluate_fn = _held_out_accuracy(cfg, init_dir, sources, closers) if dims.is_controller else None
        band = AccuracyBand(adapter, dims, s.band, evaluate_fn,
                            reading="acc of the weakest kind" if s.band_by_kind else "acc")
        steps = run_sft(actor, control, sources["sft_path"], sources["tokenizer"], num_steps=s.num_steps,
                        batch_size=s.batch_size, seed=cfg.trainer.seed, check=band, check_interval=s.check_interval,
                        fine_check_interval=s.fine_check_interval)
    finally:
        for close in closers:
            close()
    if dims.is_controller:
        assert band.best is not None, "run_sft checks after its last step"
        chosen = next(c for c in band.checks if c["step"] == band.best_step)
        if band.distance(chosen["acc"]) > 0:
            logger.warning("sft warm start: no check landed in the target band [%.2f, %.2f] within %d steps; "
                           "RL starts from step %d (held-out acc %.4f); adjust model.sft_warm_start",
                           *s.band, steps, band.best_step, chosen["acc"])
        write_hf_checkpoint(band.best, init_dir, out, record={"band": list(s.band), "checks": band.checks,
                                                              "chosen_step": band.best_step, "steps": steps})
    dist.barrier()


def _held_out_accuracy(cfg: Config, init_dir: Path, sources: dict[str, Any],
                       closers: list[Callable[[], None]]) -> Callable[[list[tuple[str, torch.Tensor]]], float]:
    """Controller: HF tensors -> their held-out accuracy as the trainer's val/acc measures it (same
    prompts, sampling settings and reward; its own seed)."""
    from megatron_dapo.collect import score_heldout, val_sampling_params
    from megatron_dapo.collect.heldout import BAND_CHECK_SEED_OFFSET
    from megatron_dapo.data.datasets import load_prompt_dataset
    from megatron_dapo.rewards.pool import REWARD_LOG, RewardPool
    from megatron_dapo.rollout.controller import RolloutController
    from megatron_dapo.rollout.factory import check_engine
    from megatron_dapo.tools.registry import episode_runner

    tokenizer = load_tokenizer(sources["tokenizer"])
    val_files = cfg.data.val_files or [sources["val"]]
    prompts = [r for f in val_files for r in load_prompt_dataset(f, tokenizer, cfg.data.max_prompt_length).records]
    engine = check_engine(init_dir)
    rollout = RolloutController([engine])
    closers.append(rollout.shutdown)
    # The run's breaker here too: without it a broken function was waited out on every held-out call.
    rewards = RewardPool(cfg.reward.reward_fn, cfg.reward.num_workers, cfg.reward.timeout_s,
                         max_failure_fraction=cfg.reward.max_failure_fraction,
                         log_path=Path(cfg.trainer.output_dir) / REWARD_LOG)
    closers.append(rewards.close)
    # The trainer's sampling, a draw of its own: the check SFT stops on is selected for a high
    # reading, so the run's step-0 val/acc must not be that same draw (collect/heldout.py).
    params = val_sampling_params(cfg.rollout.val_kwargs, max_new_tokens=cfg.data.max_response_length,
                                 eos_id=tokenizer.eos_id, seed=cfg.trainer.seed, offset=BAND_CHECK_SEED_OFFSET)
    # The trainer's val/acc: with tools.
    episodes = episode_runner(cfg.tools, tokenizer, cfg.data.max_response_length, log_dir=cfg.trainer.output_dir)
    if episodes is not None:
        closers.append(episodes.close)

    by_kind = cfg.model.sft_warm_start.band_by_kind
    if by_kind and any(not isinstance(p.extra_info, dict) or not isinstance(p.extra_info.get("kind"), str)
                       for p in prompts):
        raise UserError("model.sft_warm_start.band_by_kind: the held-out prompts name no problem kind "
                        "(extra_info.kind, which the embedded task writes); set band_by_kind: false")

    def held_out_accuracy(tensors: list[tuple[str, torch.Tensor]]) -> float:
        engine.update_weights(tensors)
        engine.finish_weight_update()
        metrics = score_heldout(prompts, rollout=rollout, rewards=rewards, tokenizer=tokenizer, params=params,
                                episodes=episodes)
        if not by_kind:
            return float(metrics["val/acc"])
        kinds = {k.removeprefix("val/acc/"): float(v) for k, v in metrics.items() if k.startswith("val/acc/")}
        logger.info("sft warm start check: held-out acc %.4f; by kind %s (the band reads the weakest)",
                    metrics["val/acc"], ", ".join(f"{k} {v:.4f}" for k, v in kinds.items()))
        return min(kinds.values())

    return held_out_accuracy


def run_sft(actor: MegatronActor, control: parallel.ControlGroups, sft_path: str, tokenizer_path: str, *,
            num_steps: int, batch_size: int, seed: int, check: AccuracyBand | None = None,
            check_interval: int = 0, fine_check_interval: int | None = None) -> int:
    """Supervised steps on worked solutions through the actor's DAPO train step (collective).

    Args:
        actor: the actor to train (its optimizer carries the SFT learning rate).
        control: the control groups the sequences are dispatched over.
        sft_path: jsonl of {prompt, response, answer} (read by the controller only).
        tokenizer_path: the task's tokenizer.
        num_steps: optimizer steps (the most, with a check).
        batch_size: sequences per step, split over data-parallel ranks by tokens.
        seed: draws the sequences of each step.
        check: held-out accuracy band, asked every `check_interval` steps and after the last.
        check_interval: steps between checks.
        fine_check_interval: steps between checks once one has come near the band (`AccuracyBand.near`).

    Returns:
        The number of steps taken.
    """
    dims = actor.dims
    rows = _load_sft_rows(sft_path, tokenizer_path) if dims.is_controller else []
    rng = random.Random(seed)
    # Ratio 1 everywhere: no clip is active and the gradient is that of the token-mean NLL.
    loss = LossSettings(clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean")
    next_check = check_interval
    for step in range(1, num_steps + 1):
        per_dp = None
        if dims.is_controller:
            chosen = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
            per_dp = [[chosen[i] for i in shard] for shard in balance_across_dp([len(p) + len(r) for p, r, _ in chosen],
                                                                                  dims.dp)]
        batch = _sft_batch(parallel.scatter_to_replicas(per_dp, control))
        # The update's own forward is the old policy (ratio exactly 1); it fills old_log_probs.
        actor.train_step(batch, loss, old_from_forward=True)
        if dims.is_controller and (step % 50 == 0 or step == num_steps):
            # Before this step's update, on this rank's share: the token-mean NLL.
            nll = -batch.old_log_probs[batch.response_mask].mean()
            logger.info("sft warm start step %d/%d: nll %.4f", step, num_steps, float(nll))
        if check is not None and (step >= next_check or step == num_steps):
            if check(actor.model, step):
                return step
            next_check = step + check_gap(check.near, check_interval, fine_check_interval)
    return num_steps


def check_gap(near: bool, check_interval: int, fine_check_interval: int | None) -> int:
    """Steps to the next band check: the fine interval once a check came near the band, never more
    than check_interval (a config with check_interval 5 keeps 5 under the default fine interval 10)."""
    if near and fine_check_interval:
        return min(fine_check_interval, check_interval)
    return check_interval


def export_hf_checkpoint(adapter: DecoderAdapter, model: Any, dims: parallel.ParallelDims, config_dir: Path,
                         out: Path) -> None:
    """Gather the model to HF tensors and write an HF checkpoint directory (collective).

    The controller writes model.safetensors plus config.json/generation_config.json copied
    from `config_dir`, atomically; the other ranks only drive the gather.
    """
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in adapter.export_hf(model, dims, receivers="controller")}
    if dims.is_controller:
        write_hf_checkpoint(tensors, config_dir, out)
    dist.barrier()


def write_hf_checkpoint(tensors: dict[str, torch.Tensor], config_dir: Path, out: Path,
                        record: dict[str, Any] | None = None) -> None:
    """model.safetensors + config.json/generation_config.json from `config_dir` (+ a record), atomically."""
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        chmod_as_created(tmp / "model.safetensors")
        for name in ("config.json", "generation_config.json"):
            if (config_dir / name).is_file():
                shutil.copy(config_dir / name, tmp / name)
        if record is not None:
            (tmp / WARM_START_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def _load_sft_rows(sft_path: str, tokenizer_path: str) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, response ids + eos, loss mask) of every worked solution.

    A solution that calls the calculator (data/arithmetic.CALC_MARKERS) learns the call and what
    follows the answer, never the answer itself: the ``<result>...</result>`` span is the tool's
    (mask 0), as in RL.
    """
    tokenizer = load_tokenizer(tokenizer_path)
    _, _, result_open, result_close = CALC_MARKERS
    rows = []
    with open(sft_path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": row["prompt"]}]))
            text = row["response"]
            start, end = text.find(result_open), text.find(result_close)
            parts = [(text, 1)] if start < 0 or end < start else \
                [(text[:start], 1), (text[start:end + len(result_close)], 0), (text[end + len(result_close):], 1)]
            ids, mask = [], []
            for part, keep in parts:
                piece = tokenizer.encode(part) if part else []
                ids += piece
                mask += [keep] * len(piece)
            rows.append((prompt, [*ids, tokenizer.eos_id], [*mask, 1]))
    return rows


def _sft_batch(rows: list[tuple[list[int], list[int], list[int]]]) -> RolloutBatch:
    lengths = [len(p) + len(r) for p, r, _ in rows] or [1]
    width = max(lengths)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (p, r, m) in enumerate(rows):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p): len(p) + len(r)] = torch.tensor(m, dtype=torch.bool)
    return RolloutBatch(input_ids=input_ids, seq_lens=torch.tensor(lengths[: len(rows)], dtype=torch.long),
                        response_mask=mask, advantages=mask.float())


def warm_started(cfg: Config, adapter: DecoderAdapter, init_dir: Path, sources: dict[str, Any],
                dims: parallel.ParallelDims, control: parallel.ControlGroups, cache_dir: Path) -> Path:
    """The SFT'd HF checkpoint of the scratch model: from the cache, or trained now."""
    # The controller's key: on a cluster of mixed CPUs the kernel level differs between nodes.
    out = Path(parallel.broadcast_object(str(sft_cache_dir(cfg, init_dir, sources, dims, cache_dir)) if dims.is_controller else None))
    if parallel.broadcast_object((out / "config.json").is_file() if dims.is_controller else None):
        logger.info("sft warm start: %s (cached)", out)
        return out
    s = cfg.model.sft_warm_start
    sft_optim = OptimConfig(lr=s.lr, weight_decay=0.0, clip_grad=cfg.optim.clip_grad,
                            lr_warmup_steps=min(10, s.num_steps))
    # SFT rows are distinct prompts, nothing to share; padded rows keep cached warm starts valid.
    actor = build_actor(cfg, adapter, init_dir, dims, optim=sft_optim, shared_prompts=False, lora=False)
    warm_start(cfg, actor, control, adapter, init_dir, sources, out)
    logger.info("sft warm start: %s (trained now, cached for the next run)", out)
    return out
