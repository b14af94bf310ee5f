"""A run's starting point: its data sources, its initial HF checkpoint and the actor built from it.

`prepare_sources` makes (or finds in the cache) the embedded task and the scratch model, or
checks the user's checkpoint and tokenizer; `warm_started` gives the scratch model's SFT warm
start (cached; trained through the actor's own step when missing); `build_actor` is this rank's
Megatron actor with the run's optimizer. `on_controller` runs a step on the controller and
hands every rank its result or its one-line error. run.py calls these in order.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo import parallel
from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
from megatron_dapo.config import Config, OptimConfig
from megatron_dapo.config.preflight import check_hf_checkpoint
from megatron_dapo.data.tokenizer import SPM_MODEL_FILENAME, load_tokenizer
from megatron_dapo.device import param_dtype
from megatron_dapo.embedded import scratch_checkpoint, task_for
from megatron_dapo.errors import SharedUserError, UserError
from megatron_dapo.models import DecoderAdapter
from megatron_dapo.models.transformer_impl import choose_transformer_impl, te_available
from megatron_dapo.warm_start import sft_cache_dir, warm_start

__all__ = ["broadcast_object", "build_actor", "model_dtype", "on_controller", "prepare_sources", "warm_started",
           "with_tokenizer"]

logger = logging.getLogger(__name__)


def model_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """The actor's parameter dtype (model.dtype: auto = bf16 on GPU, fp32 on CPU); the engines serve the same."""
    return param_dtype(cfg.model.dtype, device)


def build_actor(cfg: Config, adapter: DecoderAdapter, hf_dir: Path, dims: parallel.ParallelDims,
                optim: OptimConfig | None = None, *, shared_prompts: bool | None = None,
                lora: bool = True) -> MegatronActor:
    """The Megatron actor of this rank, loaded from an HF checkpoint, with the run's optimizer.

    shared_prompts: None = trainer.shared_prompts. lora: model.lora's adapters (the SFT warm
    start trains the whole model).
    """
    dtype = model_dtype(cfg, dims.device)
    optim = optim or cfg.optim
    if lora and cfg.model.lora.enabled and cfg.model.transformer_impl == "auto" and te_available():
        logger.warning("model.lora: the actor is built on megatron's local layer spec, not Transformer Engine's "
                       "(adapters are wired on the local spec; packed micro-batches and TE's fused kernels are off)")
    decay_steps = optim.lr_decay_steps if optim.lr_decay_steps is not None else cfg.optimizer_steps
    return MegatronActor(
        adapter=adapter, dims=dims,
        optimizer_config=make_optimizer_config(optim, dtype=dtype,
                                               use_distributed_optimizer=cfg.parallel.use_distributed_optimizer),
        lr_warmup_steps=optim.lr_warmup_steps, lr_decay=(optim.lr_decay_style, decay_steps, optim.min_lr_ratio),
        hf_checkpoint=hf_dir,
        recompute="full" if cfg.model.recompute_activations else "none",
        max_tokens_per_microbatch=cfg.trainer.max_tokens_per_microbatch,
        logprob_chunk_size=cfg.trainer.logprob_chunk_size, sequence_parallel=cfg.parallel.sequence_parallel,
        cp_comm_type=cfg.parallel.cp_comm_type, routing_replay=routing_replay_mode(cfg, adapter),
        # Adapters are wired on the local spec only: auto picks it for a LoRA actor (config refuses TE's).
        use_te=choose_transformer_impl(cfg.model.transformer_impl) and not (lora and cfg.model.lora.enabled),
        shared_prompts=cfg.trainer.shared_prompts if shared_prompts is None else shared_prompts,
        lora=cfg.model.lora if lora else None, seed=cfg.trainer.seed)


def routing_replay_mode(cfg: Config, adapter: DecoderAdapter) -> str:
    mode = cfg.algorithm.routing_replay
    if mode != "off" and not adapter.hf.is_moe:
        raise UserError(f"algorithm.routing_replay={mode} needs a mixture-of-experts model, and "
                        f"{cfg.model.hf_checkpoint} has no MoE layer; set algorithm.routing_replay=off")
    return mode


def warm_started(cfg: Config, adapter: DecoderAdapter, init_dir: Path, sources: dict[str, Any],
                dims: parallel.ParallelDims, control: parallel.ControlGroups, cache_dir: Path) -> Path:
    """The SFT'd HF checkpoint of the scratch model: from the cache, or trained now."""
    # The controller's key: on a cluster of mixed CPUs the kernel level differs between nodes.
    out = Path(broadcast_object(str(sft_cache_dir(cfg, init_dir, sources, dims, cache_dir)) if dims.is_controller else None))
    if broadcast_object((out / "config.json").is_file() if dims.is_controller else None):
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


def with_tokenizer(hf_dir: Path, spm_model: Path) -> None:
    """Put the embedded task's tokenizer into its (cached) HF directory, so that checkpoints
    carry it in hf/ and an export can be trained from (data/tokenizer.py reads it back)."""
    target = hf_dir / SPM_MODEL_FILENAME
    if target.is_file():
        return
    tmp = hf_dir / f".{SPM_MODEL_FILENAME}.{os.getpid()}"
    shutil.copyfile(spm_model, tmp)
    os.replace(tmp, target)


def prepare_sources(cfg: Config, cache_dir: Path) -> dict[str, str | None]:
    """Controller: make the embedded task and scratch checkpoint if needed; return paths."""
    if cfg.model.hf_checkpoint is not None:
        # Here, once, rather than as a traceback on every rank while the actor loads.
        check_hf_checkpoint(cfg.model.hf_checkpoint)
        load_tokenizer(cfg.model.tokenizer or cfg.model.hf_checkpoint)
        return {"hf_dir": cfg.model.hf_checkpoint, "tokenizer": cfg.model.tokenizer or cfg.model.hf_checkpoint,
                "train": None, "val": None, "sft_path": None}
    task = task_for(cfg.data.embedded, cache_dir)
    tokenizer = load_tokenizer(task.tokenizer_path)
    scratch = scratch_checkpoint(cfg.model.scratch, tokenizer.vocab_size, cfg.trainer.seed, cache_dir)
    return {"hf_dir": str(scratch), "tokenizer": str(task.tokenizer_path), "train": str(task.train_path),
            "val": str(task.val_path), "sft_path": str(task.sft_path)}


def on_controller(fn: Any) -> Any:
    """Run `fn` on the controller and broadcast its result (collective).

    A UserError there is raised on every rank as a SharedUserError, so every rank exits
    with code 2 and the message prints once, instead of the others waiting in the next
    collective for a controller that is gone.
    """
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    result, error = broadcast_object((result, error))
    if error is not None:
        raise SharedUserError(error)
    return result


def broadcast_object(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
