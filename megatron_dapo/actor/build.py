"""This rank's Megatron actor as a run's config asks for it: its dtype, optimizer, layout and adapters."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
from megatron_dapo.config import Config, OptimConfig
from megatron_dapo.device import param_dtype
from megatron_dapo.errors import UserError
from megatron_dapo.models import DecoderAdapter
from megatron_dapo.models.transformer_impl import choose_transformer_impl, te_available

__all__ = ["build_actor", "model_dtype"]

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
