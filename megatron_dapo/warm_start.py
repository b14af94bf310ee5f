"""SFT warm start of the embedded run's scratch model, with the Megatron actor itself.

RL cannot start from a policy that never produces "Answer: <n>": every group would be
all-wrong and dynamic sampling would drop them all. A few hundred supervised steps on
worked solutions bring the tiny model to a starting accuracy between about 10% and 50%.

No separate SFT code path: with advantage 1 on every response token and old log-probs
equal to the current ones, the ratio is exactly 1, no clip is active, and the DAPO
token-mean loss has exactly the gradient of the token-mean negative log-likelihood. So
SFT runs through the same actor, micro-batching and optimizer as RL (any TP/PP/DP).

The result is exported as an HF checkpoint and cached, keyed by the scratch checkpoint,
the SFT settings, the corpus and the seed; the RL actor and the engines load it like any
other HF checkpoint.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_dapo import parallel
from megatron_dapo.actor.actor import LossSettings, MegatronActor
from megatron_dapo.actor.microbatch import RolloutBatch, balance_across_dp
from megatron_dapo.config import Config
from megatron_dapo.data.tokenizer import load_tokenizer
from megatron_dapo.embedded import atomic_dir, digest
from megatron_dapo.models import DecoderAdapter

logger = logging.getLogger(__name__)


def sft_cache_dir(cfg: Config, init_dir: Path, sft_path: str, cache_dir: Path) -> Path:
    """Where the warm-started checkpoint of these settings is cached."""
    s = cfg.model.sft_warm_start
    return cache_dir / "sft-{}".format(digest({"init": init_dir.name, "sft": [s.num_steps, s.batch_size, s.lr],
                                               "corpus": sft_path, "seed": cfg.trainer.seed,
                                               "dtype": cfg.model.dtype}))


def run_sft(actor: MegatronActor, sft_path: str, tokenizer_path: str, *, num_steps: int, batch_size: int,
            seed: int) -> None:
    """Supervised steps on worked solutions through the actor's DAPO train step (collective).

    Args:
        actor: the actor to train (its optimizer carries the SFT learning rate).
        sft_path: jsonl of {prompt, response, answer} (read by the controller only).
        tokenizer_path: the task's tokenizer.
        num_steps: optimizer steps.
        batch_size: sequences per step, split over data-parallel ranks by tokens.
        seed: draws the sequences of each step.
    """
    dims = actor.dims
    rows = _load_sft_rows(sft_path, tokenizer_path) if dims.is_controller else []
    rng = random.Random(seed)
    dp_rank_of: list[Any] = [None] * dims.world_size
    dist.all_gather_object(dp_rank_of, dims.dp_rank)
    # Ratio 1 everywhere: no clip is active and the gradient is that of the token-mean NLL.
    loss = LossSettings(clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean")
    for step in range(1, num_steps + 1):
        payload: list[Any] = [None] * dims.world_size
        if dims.is_controller:
            chosen = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
            shards = balance_across_dp([len(p) + len(r) for p, r in chosen], dims.dp)
            payload = [[chosen[i] for i in shards[dp_rank_of[r]]] for r in range(dims.world_size)]
        box: list[Any] = [None]
        dist.scatter_object_list(box, payload if dims.is_controller else None, src=0)
        batch = _sft_batch(box[0])
        batch.old_log_probs, _ = actor.compute_log_probs(batch, temperature=1.0, response_only=True)
        actor.train_step(batch, loss)
        if dims.is_controller and (step % 50 == 0 or step == num_steps):
            # Before this step's update, on this rank's share: the token-mean NLL.
            nll = -batch.old_log_probs[batch.response_mask].mean()
            logger.info("sft warm start step %d/%d: nll %.4f", step, num_steps, float(nll))


def export_hf_checkpoint(adapter: DecoderAdapter, model: Any, dims: parallel.ParallelDims, config_dir: Path,
                         out: Path) -> None:
    """Gather the model to HF tensors and write an HF checkpoint directory (collective).

    The controller writes model.safetensors plus config.json/generation_config.json copied
    from `config_dir`, atomically; the other ranks only drive the gather.
    """
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in adapter.export_hf(model, dims)}
    if dims.is_controller:
        with atomic_dir(out) as tmp:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            for name in ("config.json", "generation_config.json"):
                if (config_dir / name).is_file():
                    shutil.copy(config_dir / name, tmp / name)
    dist.barrier()


def _load_sft_rows(sft_path: str, tokenizer_path: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + eos) of every worked solution."""
    tokenizer = load_tokenizer(tokenizer_path)
    rows = []
    with open(sft_path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": row["prompt"]}]))
            rows.append((prompt, [*tokenizer.encode(row["response"]), tokenizer.eos_id]))
    return rows


def _sft_batch(rows: list[tuple[list[int], list[int]]]) -> RolloutBatch:
    lengths = [len(p) + len(r) for p, r in rows] or [1]
    width = max(lengths)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p): len(p) + len(r)] = True
    return RolloutBatch(input_ids=input_ids, seq_lens=torch.tensor(lengths[: len(rows)], dtype=torch.long),
                        response_mask=mask, advantages=mask.float())

