"""Training checkpoints: atomic, resumable, reshardable (DESIGN.md, step 8 and the invariants).

A checkpoint is one directory ``<root>/step_<N>``::

    manifest.json       what is inside: step, model architecture and family, layout, format
    dist/               megatron.core.dist_checkpointing (torch_dist): the model chunks'
                        sharded_state_dict, the distributed optimizer's state in a format any
                        TP/PP/DP layout can load, the lr scheduler state
    rng/rank_<r>.pt     each rank's python/numpy/torch/megatron-tracker RNG states
    trainer_state.json  the caller's JSON-able loop state (step, consumed prompts, sampler, carry-over)
    config.yaml         the resolved experiment config
    hf/                 the source HF config.json + tokenizer files, so export needs no other input

Why it survives ``kill -9`` at any moment: every rank writes into ``<root>/.tmp-step_<N>``;
after a barrier rank 0 renames it to ``step_<N>`` (one atomic rename) and then atomically
replaces the ``latest`` pointer file (write tmp, fsync, os.replace). Until the rename the
previous checkpoint is the newest complete one; leftovers of an interrupted save are
deleted by the next save. ``manifest.json`` is written last inside the tmp dir, so a
directory without it was never complete.

Why loading into another layout works: model tensors are ShardedTensors with global
shapes, and the distributed optimizer is saved with ``fully_reshardable`` (canonical,
per-parameter state), so dist_checkpointing reslices both for the loading layout. RNG
states are per rank and only restored when the layout is unchanged (exact resume);
otherwise they are left as seeded, with a warning.

Nothing untrusted is unpickled: per-rank files load with ``torch.load(weights_only=True)``,
dist_checkpointing's common state also loads weights-only (torch >= 2.6 default), and the
pickled torch.distributed.checkpoint ``.metadata`` is first read by a restricted unpickler
that admits only checkpoint metadata classes (and checks every shard file's length).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from megatron_dapo.errors import UserError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
DIST_DIR = "dist"
RNG_DIR = "rng"
HF_DIR = "hf"
TRAINER_STATE = "trainer_state.json"
CONFIG_YAML = "config.yaml"
OPTIMIZER_SHARDINGS = ("fully_reshardable", "dp_reshardable")
"""Distributed-optimizer formats: fully_reshardable (default) gathers each parameter's state
on DP rank 0 into canonical per-parameter tensors, loadable at any TP/PP/DP;
dp_reshardable writes every rank's flat buffers in parallel (faster, less memory at 32B
scale) but then loads only at the same TP/PP (any DP)."""

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_HF_SKIP_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".index.json",
)
_HF_MAX_FILE_BYTES = 64 << 20
_ARCH_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "add_qkv_bias",
    "add_bias_linear",
    "gated_linear_unit",
    "normalization",
    "tie_word_embeddings",
)


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit the model."""


# ----------------------------------------------------------------------------- model helpers


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (their own sharded_state_dict would add 'module.')."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def model_architecture(chunk: torch.nn.Module) -> dict[str, Any]:
    """The architecture fields a checkpoint must agree on, read from a (wrapped) GPTModel chunk.

    Args:
        chunk: any pipeline stage of the model; TransformerConfig holds global sizes.

    Returns:
        A JSON-able dict keyed by ``_ARCH_FIELDS``.
    """
    model = unwrap(chunk)
    cfg = model.config
    num_query_groups = cfg.num_query_groups or cfg.num_attention_heads
    return {
        "num_layers": int(cfg.num_layers),
        "hidden_size": int(cfg.hidden_size),
        "ffn_hidden_size": int(cfg.ffn_hidden_size),
        "num_attention_heads": int(cfg.num_attention_heads),
        "num_query_groups": int(num_query_groups),
        "kv_channels": int(cfg.kv_channels),
        "vocab_size": int(model.vocab_size),
        "add_qkv_bias": bool(cfg.add_qkv_bias),
        "add_bias_linear": bool(cfg.add_bias_linear),
        "gated_linear_unit": bool(cfg.gated_linear_unit),
        "normalization": str(cfg.normalization),
        "tie_word_embeddings": bool(model.share_embeddings_and_output_weights),
    }


def model_sharded_state_dict(model_chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """{'model': sd} for one chunk, {'model0': .., 'model1': ..} for virtual pipeline chunks.

    The ShardedTensor keys inside carry global layer numbers, so the dict nesting does not
    limit which layout can load them.
    """
    if len(model_chunks) == 1:
        return {"model": unwrap(model_chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(model_chunks)}


def current_layout(model_chunks: Sequence[torch.nn.Module]) -> dict[str, int]:
    """TP/PP sizes (from the model's config) and world size of this process group."""
    cfg = unwrap(model_chunks[0]).config
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp, pp = int(cfg.tensor_model_parallel_size), int(cfg.pipeline_model_parallel_size)
    return {
        "tp": tp,
        "pp": pp,
        "dp": world // (tp * pp),
        "world_size": world,
        "num_chunks": len(model_chunks),
    }


# ----------------------------------------------------------------------------- small IO helpers


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    """Make a rename/creation inside ``path`` durable (a crash right after could lose it otherwise)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``: dist_checkpointing does not, and the rename
    that publishes the checkpoint must not become durable before its content."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


# ----------------------------------------------------------------------------- RNG states


def capture_rng_state() -> dict[str, Any]:
    """This rank's python, numpy, torch (CPU, CUDA) and megatron tracker RNG states.

    Only tensors and plain containers, so it round-trips through torch.load(weights_only=True).
    """
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    np_state = np.random.get_state(legacy=False)
    version, py_state, gauss = random.getstate()
    return {
        "python": {"version": version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        # On CPU the device layer maps torch.cuda's RNG to the CPU generator: nothing extra.
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of capture_rng_state."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": npy["bit_generator"],
            "state": {"key": npy["key"].numpy().astype(np.uint32), "pos": npy["pos"]},
            "has_gauss": npy["has_gauss"],
            "gauss": npy["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


# ----------------------------------------------------------------------------- validation


_SAFE_MODULE_PREFIXES = ("torch.distributed.checkpoint.", "torch.distributed._shard.", "megatron.core.")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what torch.distributed.checkpoint metadata is made of: its dataclasses,
    torch.Size/dtypes/memory formats, and a few builtin containers. Anything else (a
    function, os.system, ...) means the file is not what it claims to be."""

    _BUILTINS = frozenset({"set", "frozenset", "dict", "list", "tuple", "slice", "bytearray", "complex"})

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in self._BUILTINS:
            return super().find_class(module, name)
        if module == "collections" and name in ("OrderedDict", "defaultdict"):
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, torch.dtype | torch.memory_format | torch.layout):
                return obj
        if module.startswith(_SAFE_MODULE_PREFIXES) or module in ("torch.distributed.checkpoint",):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        if module == "torch.serialization" and name == "_get_layout":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _check_dist_dir(dist_dir: Path, where: str) -> None:
    """Fail with one line if the torch_dist directory is incomplete, truncated or foreign."""
    for name in ("metadata.json", ".metadata"):
        if not (dist_dir / name).is_file():
            raise CheckpointError(
                f"checkpoint {where}: {dist_dir / name} is missing; the save was interrupted or the "
                "copy is incomplete: use an earlier checkpoint or copy it again"
            )
    try:
        meta_json = json.loads((dist_dir / "metadata.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {where}: {dist_dir / 'metadata.json'} is unreadable ({e}); copy it again"
        ) from None
    if meta_json.get("sharded_backend") != "torch_dist":
        raise CheckpointError(
            f"checkpoint {where}: format {meta_json.get('sharded_backend')!r} in {dist_dir / 'metadata.json'}, "
            "expected 'torch_dist'; convert it with megatron-dapo convert"
        )
    try:
        with open(dist_dir / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {where}: {dist_dir / '.metadata'} is truncated or corrupted ({type(e).__name__}: {e}); "
            "use an earlier checkpoint"
        ) from None
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(
            f"checkpoint {where}: {dist_dir / '.metadata'} holds no shard index; use an earlier checkpoint"
        )
    needed: dict[str, int] = {}
    for info in storage.values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for rel, end in sorted(needed.items()):
        path = dist_dir / rel
        if not path.is_file():
            raise CheckpointError(
                f"checkpoint {where}: shard {path} is missing; copy the checkpoint again or use an earlier one"
            )
        size = path.stat().st_size
        if size < end:
            raise CheckpointError(
                f"checkpoint {where}: shard {path} is truncated ({size} of {end} bytes); "
                "copy the checkpoint again or use an earlier one"
            )


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Validate a checkpoint directory's files and return its manifest.

    Args:
        path: a ``step_<N>`` directory (or a converted checkpoint directory).

    Raises:
        CheckpointError: not a checkpoint, incomplete, truncated or of an unknown format version.
    """
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise CheckpointError(
            f"no checkpoint at {ckpt}: the directory does not exist; pass a step_<N> directory"
        )
    manifest_path = ckpt / MANIFEST
    if not manifest_path.is_file():
        hint = " (an unfinished save: use an earlier checkpoint)" if ckpt.name.startswith(_TMP_PREFIX) else ""
        raise CheckpointError(
            f"no checkpoint at {ckpt}: {MANIFEST} is missing{hint}; pass a step_<N> directory written by "
            "megatron-dapo (or a checkpoints root with a 'latest' file)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {ckpt}: {manifest_path} is corrupted ({e}); use an earlier checkpoint"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise CheckpointError(
            f"checkpoint {ckpt}: format_version {version!r} in {manifest_path}, this megatron-dapo reads "
            f"{FORMAT_VERSION}; use the matching megatron-dapo version"
        )
    _check_dist_dir(ckpt / DIST_DIR, str(ckpt))
    return manifest


def check_compatible(
    manifest: dict[str, Any],
    model_chunks: Sequence[torch.nn.Module],
    where: str,
    model_family: str | None = None,
) -> None:
    """Raise a CheckpointError naming every architecture field where checkpoint and model differ."""
    saved_family = manifest.get("model_family")
    if model_family and saved_family and model_family != saved_family:
        raise CheckpointError(
            f"checkpoint {where} holds a {saved_family!r} model but the config builds a {model_family!r} model; "
            "point model.hf_checkpoint at the matching family or use another checkpoint"
        )
    saved = manifest.get("model", {})
    have = model_architecture(model_chunks[0])
    diffs = [
        f"{k}={saved.get(k)!r} (model: {have[k]!r})"
        for k in _ARCH_FIELDS
        if k in saved and saved[k] != have[k]
    ]
    if diffs:
        raise CheckpointError(
            f"checkpoint {where} does not match the model: {', '.join(diffs)}; build the model from the "
            "checkpoint's own config (its hf/config.json) or pick a checkpoint of this model"
        )


# ----------------------------------------------------------------------------- lookup


def step_of(path: str | os.PathLike[str]) -> int | None:
    """N for a ``step_<N>`` directory name, else None."""
    match = _STEP_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def complete_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Published ``step_<N>`` directories under ``root`` with a manifest, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: step_of(p) or 0)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``<root>/latest`` names, or the newest complete one if the pointer is missing or stale.

    The pointer can be stale only after a crash between the publishing rename and its
    replacement; then the highest complete ``step_<N>`` is the right answer anyway.
    """
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        target = root / name
        if _STEP_RE.match(name) and (target / MANIFEST).is_file():
            newest = complete_checkpoints(root)
            if newest and (step_of(newest[-1]) or 0) > (step_of(target) or 0):
                return newest[-1]
            return target
    found = complete_checkpoints(root)
    return found[-1] if found else None


def resolve_resume(resume: str, checkpoint_root: str | os.PathLike[str]) -> Path | None:
    """What ``trainer.resume`` means: the checkpoint to load, or None to start fresh.

    Args:
        resume: "auto" (``latest`` under checkpoint_root, None if there is none), "disable"
            (None), or a path: a ``step_<N>`` directory, or a checkpoints root with a ``latest``.
        checkpoint_root: ``<output_dir>/checkpoints``.

    Raises:
        CheckpointError: an explicit path holds no loadable checkpoint.
    """
    if resume == "disable":
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoint_root)
    path = Path(resume)
    if path.is_dir() and not (path / MANIFEST).is_file():
        path = latest_checkpoint(path) or path
    read_manifest(path)
    return path


# ----------------------------------------------------------------------------- manager


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

        rank = _rank()
        final = self.root / f"step_{step}"
        tmp = self.root / f"{_TMP_PREFIX}step_{step}"
        try:
            trainer_json = json.dumps(trainer_state, sort_keys=True)
        except TypeError as e:
            raise CheckpointError(
                f"trainer_state for step {step} is not JSON-able ({e}); pass plain ints/floats/str/lists/dicts"
            ) from None
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._clean_leftovers()
            (tmp / DIST_DIR).mkdir(parents=True)
            (tmp / RNG_DIR).mkdir()
        _barrier()

        _write_checkpoint(
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
        _barrier()
        return final

    def load(
        self,
        path: str | os.PathLike[str],
        model_chunks: Sequence[torch.nn.Module],
        optimizer: Any | None = None,
        scheduler: Any | None = None,
        *,
        model_family: str | None = None,
        load_rng: bool = True,
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

        Returns:
            The trainer_state saved with the checkpoint ({} for a model-only checkpoint).

        Raises:
            CheckpointError: missing/truncated files, or the model does not match.
        """
        ckpt = Path(path)
        manifest = read_manifest(ckpt)
        check_compatible(manifest, model_chunks, str(ckpt), model_family)
        load_optimizer = optimizer is not None and manifest.get("has_optimizer", False)
        if optimizer is not None and not load_optimizer:
            logger.warning(
                "checkpoint %s has no optimizer state (a converted model): the optimizer starts fresh", ckpt
            )
        model_sd = model_sharded_state_dict(model_chunks)
        state: dict[str, Any] = model_sharded_state_dict(model_chunks)
        if load_optimizer and manifest.get("optimizer_sharding") == "dp_reshardable":
            saved, now = manifest.get("layout", {}), current_layout(model_chunks)
            if (saved.get("tp"), saved.get("pp")) != (now["tp"], now["pp"]):
                raise CheckpointError(
                    f"checkpoint {ckpt} holds dp_reshardable optimizer state saved at tp={saved.get('tp')} "
                    f"pp={saved.get('pp')}, which loads only at that TP/PP (now tp={now['tp']} pp={now['pp']}); "
                    "resume with the saved layout, or load the model alone (optimizer=None)"
                )
        if load_optimizer:
            _prime_optimizer_state(optimizer)
            state["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=True, metadata=_optim_metadata(manifest.get("optimizer_sharding"))
            )
        loaded = _dist_load(state, ckpt)
        model_keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
        for key, chunk in zip(model_keys, model_chunks):
            unwrap(chunk).load_state_dict(loaded[key], strict=True)
        if load_optimizer:
            with _torch_adam_step_kept_aside(optimizer):
                optimizer.load_state_dict(loaded["optimizer"])
        if scheduler is not None and manifest.get("has_scheduler") and "scheduler" in loaded:
            if hasattr(scheduler, "num_steps"):
                # OptimizerParamScheduler.load_state_dict ADDS the saved step count to its
                # own: a scheduler that already stepped would end up ahead.
                scheduler.num_steps = 0
            scheduler.load_state_dict(loaded["scheduler"])
        if load_rng and manifest.get("has_rng"):
            self._load_rng(ckpt, manifest, model_chunks)
        _barrier()
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
            if _rank() == 0:
                logger.warning(
                    "checkpoint %s was saved at %s, now %s: RNG states stay as seeded (not bit-exact resume)",
                    ckpt,
                    {k: saved.get(k) for k in ("tp", "pp", "world_size")},
                    {k: now[k] for k in ("tp", "pp", "world_size")},
                )
            return
        rng_path = ckpt / RNG_DIR / f"rank_{_rank():05d}.pt"
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
            if p.name.startswith(_TMP_PREFIX):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        p.unlink()

    def _publish(self, tmp: Path, final: Path) -> None:
        if final.exists():
            # Re-saving a step (after resuming from an older checkpoint): move the old copy
            # aside first; `latest` falls back to the newest complete dir if we die in between.
            aside = self.root / f"{_TMP_PREFIX}replaced-{final.name}-{time.time_ns()}"
            os.rename(final, aside)
            os.rename(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)
        atomic_write_text(self.root / LATEST, final.name + "\n")

    def _prune(self, keep: Path) -> None:
        if self.keep_last == 0:
            return
        found = complete_checkpoints(self.root)
        for old in found[: max(0, len(found) - self.keep_last)]:
            if old != keep:
                # Renamed first so a crash mid-delete leaves a .tmp- leftover, not a broken step_<N>.
                aside = self.root / f"{_TMP_PREFIX}deleting-{old.name}"
                os.rename(old, aside)
                shutil.rmtree(aside, ignore_errors=True)


def _write_checkpoint(
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
) -> None:
    """Fill the (empty, existing) directory ``tmp`` on every rank; the manifest goes in last."""
    from megatron.core import dist_checkpointing

    if importlib.util.find_spec("psutil") is None:
        # Without it megatron's torch_dist writer dies in a forked worker and the save hangs.
        raise CheckpointError(
            "saving a torch_dist checkpoint needs psutil (megatron-core's writer uses it): pip install psutil"
        )

    rank = _rank()
    state: dict[str, Any] = model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        model_sd = model_sharded_state_dict(model_chunks)
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=False, metadata=_optim_metadata(optimizer_sharding)
        )
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, str(tmp / DIST_DIR), content_metadata=_optim_metadata(optimizer_sharding))
    if with_rng:
        buf = io.BytesIO()
        torch.save(capture_rng_state(), buf)
        _write_synced(tmp / RNG_DIR / f"rank_{rank:05d}.pt", buf.getvalue())
    manifest: dict[str, Any] = {}
    if rank == 0:
        for name, data in extra_files.items():
            _write_synced(tmp / name, data)
        family = model_family
        if hf_dir is not None:
            family = copy_hf_files(hf_dir, tmp / HF_DIR) or family
        manifest = build_manifest(model_chunks, step=step, family=family, has_optimizer=optimizer is not None)
        manifest["optimizer_sharding"] = optimizer_sharding if optimizer is not None else None
        manifest["has_scheduler"] = scheduler is not None
        manifest["has_rng"] = with_rng
    _barrier()
    if rank == 0:
        _fsync_tree(tmp)
        # The manifest is the completeness mark, so it goes in after everything else is durable.
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
        _fsync_dir(tmp)


def save_model_checkpoint(
    out: str | os.PathLike[str],
    model_chunks: Sequence[torch.nn.Module],
    *,
    hf_dir: str | os.PathLike[str] | None = None,
    model_family: str | None = None,
) -> Path:
    """Write a model-only checkpoint (no optimizer, RNG or trainer state) to ``out``; collective.

    What HF -> Megatron conversion produces; the trainer loads it as an initial checkpoint.
    Written next to ``out`` and renamed into place, so ``out`` is complete or absent.

    Args:
        out: target directory; must not exist yet.
        model_chunks: this rank's model chunks, weights loaded.
        hf_dir: HF directory whose config + tokenizer files are embedded (for export).
        model_family: family name if hf_dir is None.

    Returns:
        ``out`` as a Path.
    """
    out = Path(out)
    tmp = out.parent / f"{_TMP_PREFIX}{out.name}"
    if _rank() == 0:
        if out.exists() and any(out.iterdir()):
            raise CheckpointError(
                f"output directory {out} exists and is not empty; pass a new --out directory"
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / DIST_DIR).mkdir(parents=True)
    _barrier()
    _write_checkpoint(
        tmp,
        model_chunks,
        None,
        None,
        step=None,
        extra_files={},
        hf_dir=hf_dir,
        model_family=model_family,
        with_rng=False,
    )
    if _rank() == 0:
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    _barrier()
    return out


def _prime_optimizer_state(optimizer: Any) -> None:
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
def _torch_adam_step_kept_aside(optimizer: Any) -> Iterator[None]:
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


def _optim_metadata(sharding: str | None = None) -> dict[str, Any]:
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
        "params_dtype": str(unwrap(model_chunks[0]).config.params_dtype).removeprefix("torch."),
        "has_optimizer": has_optimizer,
        "optimizer_sharding": OPTIMIZER_SHARDINGS[0] if has_optimizer else None,
        "has_scheduler": False,
        "has_rng": False,
        "megatron_core": _mcore_version(),
        "created_unix": int(time.time()),
    }


def _mcore_version() -> str:
    from megatron.core import package_info

    return str(package_info.__version__)


def _dist_load(state: dict[str, Any], ckpt: Path) -> dict[str, Any]:
    """dist_checkpointing.load with file-level failures turned into one-line CheckpointErrors."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        return dist_checkpointing.load(state, str(ckpt / DIST_DIR))
    except (CheckpointingException, OSError, EOFError, pickle.UnpicklingError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {ckpt}: loading {ckpt / DIST_DIR} failed ({type(e).__name__}: {first[:300]}); "
            "the checkpoint is corrupted or from another model: use an earlier checkpoint"
        ) from None


def copy_hf_files(hf_dir: str | os.PathLike[str], dest: Path) -> str | None:
    """Copy an HF directory's config and tokenizer files (not its weights) into ``dest``.

    Args:
        hf_dir: an HF model directory, or a checkpoint's ``hf/`` directory.
        dest: the target directory (created).

    Returns:
        The config's ``model_type`` (the family, e.g. "qwen2"), or None without a config.json.
    """
    src = Path(hf_dir)
    if not src.is_dir():
        raise CheckpointError(f"HF directory {src} does not exist; fix model.hf_checkpoint or --hf")
    dest.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.endswith(_HF_SKIP_SUFFIXES) or p.stat().st_size > _HF_MAX_FILE_BYTES:
            continue
        shutil.copyfile(p, dest / p.name)
    cfg = dest / "config.json"
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text()).get("model_type")
    except ValueError as e:
        raise CheckpointError(
            f"{src / 'config.json'} is not valid JSON ({e}); fix or re-download the HF checkpoint"
        ) from None


def hf_files_of(path: str | os.PathLike[str]) -> Path | None:
    """A checkpoint's embedded ``hf/`` directory, or None if it has none."""
    hf = Path(path) / HF_DIR
    return hf if (hf / "config.json").is_file() else None
