"""What one checkpoint directory holds, written and read through megatron-core dist_checkpointing.

manager.py decides where and when (the temporary directory, the atomic publish, pruning,
resume, errors of a failed save); this module fills a directory with the model chunks'
and the optimizer's sharded state, the scheduler, the per-rank RNG states and the
manifest (written last, it marks the directory complete), and loads that state back.

Also the megatron-core 0.16.1 workarounds a save/load cycle needs without Apex/TE (the CPU
case): a fresh optimizer has no torch Adam state to describe, and loading shares one "step"
tensor across parameters; see prime_optimizer_state and torch_adam_step_kept_aside.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import pickle
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.checkpoint.files import (
    DIST_DIR,
    FORMAT_VERSION,
    HF_DIR,
    MANIFEST,
    OPTIMIZER_SHARDINGS,
    RNG_DIR,
    CheckpointError,
    barrier,
    copy_hf_files,
    fsync_dir,
    fsync_tree,
    process_rank,
    write_synced,
)
from megatron_dapo.checkpoint.format import (
    _MetadataUnpickler,
    current_layout,
    lora_manifest,
    model_architecture,
    model_sharded_state_dict,
    unwrap,
)
from megatron_dapo.checkpoint.integrity import checksum_tree
from megatron_dapo.checkpoint.rng import capture_rng_state
from megatron_dapo.checkpoint.spec_keys import StoredIndex, align_to_checkpoint, layer_spec_of, restore_kept

logger = logging.getLogger(__name__)

__all__ = [
    "build_manifest",
    "dist_load",
    "optim_metadata",
    "prime_optimizer_state",
    "torch_adam_step_kept_aside",
    "write_checkpoint",
]


def write_checkpoint(
    tmp: Path,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any | None,
    scheduler: Any | None,
    *,
    step: int | None,
    extra_files: dict[str, bytes],
    hf_dir: str | os.PathLike[str] | None,
    model_family: str | None,
    with_rng: bool,
    optimizer_sharding: str = OPTIMIZER_SHARDINGS[0],
    sharded_strategy: Any | None = None,
) -> None:
    """Fill the (empty, existing) directory ``tmp`` on every rank; the manifest goes in last.

    ``sharded_strategy`` replaces dist_checkpointing's default torch_dist writer (the
    streaming converter's, checkpoint/streaming.py); None keeps megatron's.
    """
    from megatron.core import dist_checkpointing

    if importlib.util.find_spec("psutil") is None:
        # Without it megatron's torch_dist writer dies in a forked worker and the save hangs.
        raise CheckpointError(
            "saving a torch_dist checkpoint needs psutil (megatron-core's writer uses it): pip install psutil"
        )

    rank = process_rank()
    state: dict[str, Any] = model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        model_sd = model_sharded_state_dict(model_chunks)
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=False, metadata=optim_metadata(optimizer_sharding)
        )
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, str(tmp / DIST_DIR), sharded_strategy=sharded_strategy,
                            content_metadata=optim_metadata(optimizer_sharding))
    if with_rng:
        buf = io.BytesIO()
        torch.save(capture_rng_state(), buf)
        write_synced(tmp / RNG_DIR / f"rank_{rank:05d}.pt", buf.getvalue())
    manifest: dict[str, Any] = {}
    if rank == 0:
        for name, data in extra_files.items():
            write_synced(tmp / name, data)
        family = model_family
        if hf_dir is not None:
            family = copy_hf_files(hf_dir, tmp / HF_DIR) or family
        manifest = build_manifest(model_chunks, step=step, family=family, has_optimizer=optimizer is not None)
        manifest["optimizer_sharding"] = optimizer_sharding if optimizer is not None else None
        manifest["has_scheduler"] = scheduler is not None
        manifest["has_rng"] = with_rng
    barrier()
    checksums = checksum_tree(tmp)  # collective: every rank sums its share of the files
    if rank == 0:
        manifest["checksums"] = checksums
        fsync_tree(tmp)
        # The manifest is the completeness mark, so it goes in after everything else is durable.
        write_synced(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
        fsync_dir(tmp)


def prime_optimizer_state(optimizer: Any) -> None:
    """Give a never-stepped optimizer its Adam state tensors and step counter.

    Without Apex/TE (CPU), DistributedOptimizer.state_dict() reads the step from torch
    Adam's per-parameter state, which exists only after a first step; building the loading
    state dict of a fresh optimizer would fail. The loaded checkpoint overwrites all of it.
    """
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    if HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner, init_fn = getattr(opt, "optimizer", None), getattr(opt, "init_state_fn", None)
        if inner is None or init_fn is None or len(inner.state) > 0:
            continue
        init_fn(inner, getattr(opt, "config", None))
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0))


@contextlib.contextmanager
def torch_adam_step_kept_aside(optimizer: Any) -> Iterator[None]:
    """Work around megatron-core 0.16.1 loading torch Adam state (no Apex/TE, e.g. CPU).

    DistributedOptimizer.load_state_dict puts the checkpoint's step into every parameter's
    torch Adam state as ONE shared tensor, then copies the loaded tensors over that state
    key by key and fails on "step", which the loaded tensors rightly lack. Keeping "step"
    out of the state during each copy loads exactly what was saved; giving every parameter
    its own step tensor afterwards keeps Adam from incrementing the shared one once per
    parameter (which would change every later bias correction).
    """
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    patched = []
    if not HAVE_APEX_OR_TE:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if isinstance(opt, DistributedOptimizer):
                patched.append(opt)
                opt._set_main_param_and_optimizer_states = _step_preserving_setter(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states
    for opt in patched:
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _step_preserving_setter(opt: Any) -> Any:
    original = type(opt)._set_main_param_and_optimizer_states

    def setter(model_param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]) -> None:
        group_index, group_order = opt.model_param_group_index_map[model_param]
        main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
        state = opt.optimizer.state[main_param]
        step = state.pop("step", None)
        try:
            original(opt, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    return setter


def optim_metadata(sharding: str | None = None) -> dict[str, Any]:
    """sharded_state_dict metadata for model and optimizer (as Megatron-LM builds it)."""
    return {
        "distrib_optim_sharding_type": sharding or OPTIMIZER_SHARDINGS[0],
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }


def build_manifest(
    model_chunks: Sequence[torch.nn.Module], *, step: int | None, family: str | None, has_optimizer: bool
) -> dict[str, Any]:
    """The manifest.json content for a checkpoint of ``model_chunks``."""
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "model_family": family,
        "model": model_architecture(model_chunks[0]),
        "layout": current_layout(model_chunks),
        "layer_spec": layer_spec_of(unwrap(model_chunks[0])),
        "params_dtype": str(unwrap(model_chunks[0]).config.params_dtype).removeprefix("torch."),
        "has_optimizer": has_optimizer,
        "optimizer_sharding": OPTIMIZER_SHARDINGS[0] if has_optimizer else None,
        "has_scheduler": False,
        "has_rng": False,
        "lora": lora_manifest(model_chunks[0]),
        "megatron_core": _mcore_version(),
        "created_unix": int(time.time()),
    }


def _mcore_version() -> str:
    from megatron.core import package_info

    return str(package_info.__version__)


def dist_load(state: dict[str, Any], ckpt: Path) -> dict[str, Any]:
    """dist_checkpointing.load of a request aligned with the checkpoint's layer spec (spec_keys.py),
    with file-level failures turned into one-line CheckpointErrors."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    with open(ckpt / DIST_DIR / ".metadata", "rb") as f:
        stored = StoredIndex.from_metadata(_MetadataUnpickler(f).load())
    renamed, kept = align_to_checkpoint(state, stored)
    if renamed or kept:
        logger.info("checkpoint %s was written under the other layer spec: %d tensors read by their other name "
                    "(e.g. %s), %d extra states kept from the model", ckpt, len(renamed),
                    renamed[0] if renamed else "-", len(kept))
    try:
        loaded = dist_checkpointing.load(state, str(ckpt / DIST_DIR))
        restore_kept(loaded, kept)
        return loaded
    except (CheckpointingException, OSError, EOFError, pickle.UnpicklingError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {ckpt}: loading {ckpt / DIST_DIR} failed ({type(e).__name__}: {first[:300]}); "
            "the checkpoint is corrupted or from another model: use an earlier checkpoint"
        ) from None
