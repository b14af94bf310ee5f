"""CheckpointManager: collective save/load of model, distributed optimizer, scheduler, RNG, trainer state.

This module owns the checkpoint directories' lifetime: the temporary directory, the
atomic publish and the `latest` pointer, pruning, discarding a replaced history, and a
failed save turned into one line that names its operating-system cause. What goes inside
one directory, and the megatron-core workarounds to write and read it, is dist_state.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from megatron_dapo.checkpoint.dist_state import (
    build_manifest,
    dist_load,
    optim_metadata,
    prime_optimizer_state,
    torch_adam_step_kept_aside,
    write_checkpoint,
)
from megatron_dapo.checkpoint.files import (
    CONFIG_YAML,
    DIST_DIR,
    LATEST,
    OPTIMIZER_SHARDINGS,
    RNG_DIR,
    TMP_PREFIX,
    TRAINER_STATE,
    CheckpointError,
    atomic_write_text,
    barrier,
    fsync_dir,
    process_rank,
)
from megatron_dapo.checkpoint.format import (
    check_compatible,
    check_lora_compatible,
    complete_checkpoints,
    current_layout,
    latest_checkpoint,
    model_sharded_state_dict,
    read_manifest,
    step_of,
    unwrap,
)
from megatron_dapo.checkpoint.integrity import verify_checksums
from megatron_dapo.checkpoint.rng import restore_rng_state
from megatron_dapo.checkpoint.spec_keys import layer_spec_of
from megatron_dapo.faults import fault_point
from megatron_dapo.lora import load_state as load_lora_state
from megatron_dapo.lora import lora_of

__all__ = ["CheckpointManager", "build_manifest", "os_error_in", "save_model_checkpoint"]

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves, finds and loads training checkpoints under one root directory.

    Every rank constructs it with the same arguments and calls save/load collectively.
    """

    def __init__(
        self, root: str | os.PathLike[str], keep_last: int = 2, optimizer_sharding: str = "fully_reshardable"
    ) -> None:
        """
        Args:
            root: checkpoints directory, e.g. ``<output_dir>/checkpoints``.
            keep_last: keep the newest K checkpoints, delete older ones after a save (0 = all).
            optimizer_sharding: one of OPTIMIZER_SHARDINGS, for saving (loading reads the
                checkpoint's own).
        """
        if optimizer_sharding not in OPTIMIZER_SHARDINGS:
            raise CheckpointError(
                f"optimizer_sharding={optimizer_sharding!r} is not one of {OPTIMIZER_SHARDINGS}; pick one of those"
            )
        self.optimizer_sharding = optimizer_sharding
        if keep_last < 0:
            raise CheckpointError(
                f"keep_last={keep_last} must be >= 0 (0 = keep all); fix trainer.max_checkpoints_to_keep"
            )
        self.root = Path(root)
        self.keep_last = keep_last

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return latest_checkpoint(self.root)

    def save(
        self,
        step: int,
        model_chunks: Sequence[torch.nn.Module],
        optimizer: Any | None,
        scheduler: Any | None,
        trainer_state: dict[str, Any],
        config_dict: dict[str, Any],
        *,
        hf_dir: str | os.PathLike[str] | None = None,
        model_family: str | None = None,
    ) -> Path:
        """Write ``<root>/step_<step>`` atomically; collective over all ranks.

        Args:
            step: completed RL steps; also the directory name.
            model_chunks: this rank's model chunks (DDP-wrapped or not).
            optimizer: megatron optimizer (DistributedOptimizer / ChainedOptimizer) or None.
            scheduler: object with state_dict()/load_state_dict() (OptimizerParamScheduler) or None.
            trainer_state: JSON-able loop state; the same on every rank (rank 0's is written).
            config_dict: the resolved config (config.to_dict), stored as YAML.
            hf_dir: directory with the source HF config.json + tokenizer files to embed
                (an HF checkpoint, or a previous checkpoint's ``hf/``).
            model_family: e.g. "qwen2", "llama"; default: model_type of hf_dir's config.json.

        Returns:
            The published checkpoint directory.
        """

        rank = process_rank()
        final = self.root / f"step_{step}"
        tmp = self.root / f"{TMP_PREFIX}step_{step}"
        try:
            trainer_json = json.dumps(trainer_state, sort_keys=True)
        except TypeError as e:
            raise CheckpointError(
                f"trainer_state for step {step} is not JSON-able ({e}); pass plain ints/floats/str/lists/dicts"
            ) from None
        try:
            if rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                self._clean_leftovers()
                (tmp / DIST_DIR).mkdir(parents=True)
                (tmp / RNG_DIR).mkdir()
            barrier()
            fault_point("save", rank)
            write_checkpoint(
                tmp,
                model_chunks,
                optimizer,
                scheduler,
                step=step,
                extra_files={
                    TRAINER_STATE: trainer_json.encode(),
                    CONFIG_YAML: yaml.safe_dump(config_dict, sort_keys=False).encode(),
                },
                hf_dir=hf_dir,
                model_family=model_family,
                with_rng=True,
                optimizer_sharding=self.optimizer_sharding,
            )
            if rank == 0:
                self._publish(tmp, final)
                self._prune(keep=final)
        except BaseException as e:  # torch's CheckpointException is a BaseException
            cause = os_error_in(e) or _disk_full(self.root)
            if cause is None:
                raise
            if rank == 0:
                # Free what the failed save wrote: after a full disk it is what fills it.
                shutil.rmtree(tmp, ignore_errors=True)
            previous = self.latest()
            kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
            raise CheckpointError(
                f"saving checkpoint step {step} to {self.root} failed: {cause}; {kept}. "
                "Free space (or fix the permissions) and rerun the same command to resume"
            ) from None
        barrier()
        return final

    def discard_after(self, step: int) -> list[Path]:
        """Delete complete checkpoints newer than ``step`` (rank 0, after resuming from ``step``).

        They belong to the history the resumed run replaces; left in place, a later
        ``resume=auto`` would take the newest of them and mix the two histories.
        """
        removed = []
        for ckpt in complete_checkpoints(self.root):
            if (step_of(ckpt) or 0) > step:
                aside = self.root / f"{TMP_PREFIX}discarded-{ckpt.name}"
                os.rename(ckpt, aside)
                shutil.rmtree(aside, ignore_errors=True)
                removed.append(ckpt)
        if removed:
            logger.warning("resumed from step %d: removed the newer checkpoints %s of the replaced history",
                           step, ", ".join(p.name for p in removed))
        return removed

    def load(
        self,
        path: str | os.PathLike[str],
        model_chunks: Sequence[torch.nn.Module],
        optimizer: Any | None = None,
        scheduler: Any | None = None,
        *,
        model_family: str | None = None,
        load_rng: bool = True,
        verified: bool = False,
    ) -> dict[str, Any]:
        """Load a checkpoint into this rank's model chunks (and optimizer, scheduler, RNG).

        Works across layouts (saved at TP=2, loaded at TP=1 or PP=2). A checkpoint without
        optimizer state (a converted HF model) loads the model only: an initial checkpoint.

        Args:
            path: a ``step_<N>`` directory (see resolve_resume).
            model_chunks: this rank's model chunks, built for the checkpoint's architecture.
            optimizer: the megatron optimizer to restore, or None to skip.
            scheduler: the lr scheduler to restore, or None to skip.
            model_family: the family the config builds ("qwen2", "llama"), checked if given.
            load_rng: restore RNG states (only when the layout equals the saved one).
            verified: the caller already ran verify_checksums on it (the trainer does, before
                its warm start); skip reading every file again.

        Returns:
            The trainer_state saved with the checkpoint ({} for a model-only checkpoint).

        Raises:
            CheckpointError: missing/truncated files, or the model does not match.
        """
        ckpt = Path(path)
        manifest = read_manifest(ckpt)
        check_compatible(manifest, model_chunks, str(ckpt), model_family)
        check_lora_compatible(manifest, model_chunks[0], str(ckpt))
        if not verified:
            verify_checksums(ckpt, manifest)
        load_optimizer = optimizer is not None and manifest.get("has_optimizer", False)
        if optimizer is not None and not load_optimizer:
            logger.warning(
                "checkpoint %s has no optimizer state (a converted model): the optimizer starts fresh", ckpt
            )
        model_sd = model_sharded_state_dict(model_chunks)
        state: dict[str, Any] = model_sharded_state_dict(model_chunks)
        if load_optimizer and manifest.get("optimizer_sharding") == "dp_reshardable":
            saved, now = manifest.get("layout", {}), current_layout(model_chunks)
            spec, saved_spec = layer_spec_of(unwrap(model_chunks[0])), manifest.get("layer_spec", "local")
            if saved_spec != spec:
                raise CheckpointError(
                    f"checkpoint {ckpt} holds dp_reshardable optimizer state of the {saved_spec} layer spec, whose "
                    f"flat buffers follow that spec's parameter order; this run builds the {spec} spec "
                    "(model.transformer_impl): resume with the saved spec, or load the model alone (optimizer=None)"
                )
            if (saved.get("tp"), saved.get("pp")) != (now["tp"], now["pp"]):
                raise CheckpointError(
                    f"checkpoint {ckpt} holds dp_reshardable optimizer state saved at tp={saved.get('tp')} "
                    f"pp={saved.get('pp')}, which loads only at that TP/PP (now tp={now['tp']} pp={now['pp']}); "
                    "resume with the saved layout, or load the model alone (optimizer=None)"
                )
        if load_optimizer:
            prime_optimizer_state(optimizer)
            state["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=True, metadata=optim_metadata(manifest.get("optimizer_sharding"))
            )
        loaded = dist_load(state, ckpt)
        model_keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
        for key, chunk in zip(model_keys, model_chunks):
            lora = lora_of(chunk)
            if lora is None:
                unwrap(chunk).load_state_dict(loaded[key], strict=True)
            else:  # adapters only: the base came from its HF directory (lora/state.py)
                load_lora_state(lora, loaded[key])
        if load_optimizer:
            # no_grad: megatron's dp_reshardable path copies into views of leaf parameters
            # without it (its fully_reshardable path has it).
            with torch_adam_step_kept_aside(optimizer), torch.no_grad():
                optimizer.load_state_dict(loaded["optimizer"])
        elif optimizer is not None:
            # The optimizer's fp32 main params were copied from the model before this load
            # (bf16 training): refresh them, or the first step would revert the weights.
            optimizer.reload_model_params()
        if scheduler is not None and manifest.get("has_scheduler") and "scheduler" in loaded:
            if hasattr(scheduler, "num_steps"):
                # OptimizerParamScheduler.load_state_dict ADDS the saved step count to its
                # own: a scheduler that already stepped would end up ahead.
                scheduler.num_steps = 0
            scheduler.load_state_dict(loaded["scheduler"])
        if load_rng and manifest.get("has_rng"):
            self._load_rng(ckpt, manifest, model_chunks)
        barrier()
        state_path = ckpt / TRAINER_STATE
        if not state_path.is_file():
            return {}
        try:
            return json.loads(state_path.read_text())
        except ValueError as e:
            raise CheckpointError(
                f"checkpoint {ckpt}: {state_path} is corrupted ({e}); use an earlier checkpoint"
            ) from None

    # --------------------------------------------------------------------- internals

    def _load_rng(
        self, ckpt: Path, manifest: dict[str, Any], model_chunks: Sequence[torch.nn.Module]
    ) -> None:
        now = current_layout(model_chunks)
        saved = manifest.get("layout", {})
        if any(saved.get(k) != now[k] for k in ("tp", "pp", "world_size")):
            if process_rank() == 0:
                logger.warning(
                    "checkpoint %s was saved at %s, now %s: RNG states stay as seeded (not bit-exact resume)",
                    ckpt,
                    {k: saved.get(k) for k in ("tp", "pp", "world_size")},
                    {k: now[k] for k in ("tp", "pp", "world_size")},
                )
            return
        rng_path = ckpt / RNG_DIR / f"rank_{process_rank():05d}.pt"
        try:
            rng = torch.load(rng_path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint {ckpt}: {rng_path} is missing; copy the checkpoint again"
            ) from None
        except (RuntimeError, pickle.UnpicklingError, EOFError, OSError) as e:
            raise CheckpointError(
                f"checkpoint {ckpt}: {rng_path} is truncated or corrupted ({e}); use an earlier checkpoint"
            ) from None
        restore_rng_state(rng)

    def _clean_leftovers(self) -> None:
        """Delete what interrupted saves left behind (rank 0, before a new save)."""
        for p in self.root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        p.unlink()

    def _publish(self, tmp: Path, final: Path) -> None:
        if final.exists():
            # Re-saving a step (after resuming from an older checkpoint): move the old copy
            # aside first; `latest` falls back to the newest complete dir if we die in between.
            aside = self.root / f"{TMP_PREFIX}replaced-{final.name}-{time.time_ns()}"
            os.rename(final, aside)
            os.rename(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(self.root)
        atomic_write_text(self.root / LATEST, final.name + "\n")

    def _prune(self, keep: Path) -> None:
        if self.keep_last == 0:
            return
        found = complete_checkpoints(self.root)
        for old in found[: max(0, len(found) - self.keep_last)]:
            if old != keep:
                # Renamed first so a crash mid-delete leaves a .tmp- leftover, not a broken step_<N>.
                aside = self.root / f"{TMP_PREFIX}deleting-{old.name}"
                os.rename(old, aside)
                shutil.rmtree(aside, ignore_errors=True)


def save_model_checkpoint(
    out: str | os.PathLike[str],
    model_chunks: Sequence[torch.nn.Module],
    *,
    hf_dir: str | os.PathLike[str] | None = None,
    model_family: str | None = None,
    sharded_strategy: Any | None = None,
) -> Path:
    """Write a model-only checkpoint (no optimizer, RNG or trainer state) to ``out``; collective.

    What HF -> Megatron conversion produces; the trainer loads it as an initial checkpoint.
    Written next to ``out`` and renamed into place, so ``out`` is complete or absent.

    Args:
        out: target directory; must not exist yet.
        model_chunks: this rank's model chunks, weights loaded.
        hf_dir: HF directory whose config + tokenizer files are embedded (for export).
        model_family: family name if hf_dir is None.
        sharded_strategy: dist_checkpointing save strategy; None = megatron's torch_dist writer
            (checkpoint/streaming.py has the one-tensor-at-a-time one).

    Returns:
        ``out`` as a Path.
    """
    out = Path(out)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}"
    if process_rank() == 0:
        if out.exists() and any(out.iterdir()):
            raise CheckpointError(
                f"output directory {out} exists and is not empty; pass a new --out directory"
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / DIST_DIR).mkdir(parents=True)
    barrier()
    write_checkpoint(
        tmp,
        model_chunks,
        None,
        None,
        step=None,
        extra_files={},
        hf_dir=hf_dir,
        model_family=model_family,
        with_rng=False,
        sharded_strategy=sharded_strategy,
    )
    if process_rank() == 0:
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
        fsync_dir(out.parent)
    barrier()
    return out


def os_error_in(err: BaseException) -> str | None:
    """The operating-system failure behind a save error, as one line, or None if there is none.

    torch.distributed.checkpoint wraps a writer's OSError (disk full, read-only) in its
    own exception types, sometimes only as text of a remote rank's traceback.
    """
    seen: set[int] = set()
    stack: list[BaseException] = [err]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return f"{os.strerror(e.errno)} (errno {e.errno}{', ' + str(e.filename) if e.filename else ''})"
        stack += [c for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)  # torch CheckpointException: rank -> (exception, trace)
        if isinstance(failures, dict):
            stack += [f[0] for f in failures.values() if isinstance(f, tuple) and isinstance(f[0], BaseException)]
    text = str(err)
    for errno_name in ("No space left on device", "Read-only file system", "Permission denied",
                       "Disk quota exceeded"):
        if errno_name in text:
            return errno_name
    return None


# Less free space than this after a failed save means the disk filled up: torch.save reports
# a full disk as "basic_ios::clear: iostream error" / "unexpected pos", without the errno.
_DISK_FULL_MARGIN_BYTES = 16 << 20


def _disk_full(path: Path) -> str | None:
    """'No space left on device (...)' if the filesystem of ``path`` is (nearly) full, else None."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= _DISK_FULL_MARGIN_BYTES:
        return None
    return f"No space left on device ({free >> 10} KiB free)"
