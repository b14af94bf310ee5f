"""What a checkpoint must contain and whom it fits: validation, architecture checks, lookup.

Validation reads nothing it has not checked: the torch.distributed.checkpoint ``.metadata``
pickle goes through a restricted unpickler that admits only checkpoint metadata classes,
and every shard file it names must exist with at least the bytes it indexes, so missing,
truncated and foreign checkpoints fail with one line before megatron touches them.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.checkpoint.files import (
    ARCH_FIELDS,
    DIST_DIR,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    STEP_RE,
    TMP_PREFIX,
    CheckpointError,
)
from megatron_dapo.lora import lora_of
from megatron_dapo.lora import sharded_state_dict as lora_sharded_state_dict


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
        A JSON-able dict keyed by ``ARCH_FIELDS``.
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
        return {"model": _chunk_sharded_state_dict(model_chunks[0])}
    return {f"model{i}": _chunk_sharded_state_dict(c) for i, c in enumerate(model_chunks)}


def _chunk_sharded_state_dict(chunk: torch.nn.Module) -> dict[str, Any]:
    """A chunk's sharded state: a LoRA model's is its adapters alone (the base is its HF directory)."""
    lora = lora_of(chunk)
    return unwrap(chunk).sharded_state_dict() if lora is None else lora_sharded_state_dict(lora)


def lora_manifest(chunk: torch.nn.Module) -> dict[str, Any] | None:
    """The manifest's ``lora`` entry of a chunk: rank, alpha, targets and the base's identity; None without LoRA."""
    lora = lora_of(chunk)
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets), "base": lora.base}


def check_lora_compatible(manifest: dict[str, Any], chunk: torch.nn.Module, where: str) -> None:
    """Refuse in one line a checkpoint whose adapters (or their absence) or base differ from the model's."""
    saved, have = manifest.get("lora"), lora_manifest(chunk)
    if saved is None and have is None:
        return
    if saved is None or have is None:
        held = "adapters only (a LoRA run)" if saved is not None else "a full model (no LoRA)"
        fix = "set model.lora.rank=0" if saved is None else f"set model.lora.rank={saved['rank']}"
        raise CheckpointError(f"checkpoint {where} holds {held}, and this run builds "
                              f"{'a LoRA' if have is not None else 'a full-parameter'} actor: {fix}, or use another checkpoint")
    diffs = [f"{k}={saved.get(k)!r} (run: {have[k]!r})" for k in ("rank", "alpha", "targets") if saved.get(k) != have[k]]
    if diffs:
        raise CheckpointError(f"checkpoint {where} holds LoRA adapters of {', '.join(diffs)}: set model.lora to the "
                              "checkpoint's, or start a new run")
    base, now = saved.get("base") or {}, have["base"] or {}
    if base.get("fingerprint") != now.get("fingerprint"):
        raise CheckpointError(f"checkpoint {where} holds LoRA adapters of the base {base.get('path')}, and this run's "
                              f"base {now.get('path')} has other weights: resume on the checkpoint's base "
                              "(model.hf_checkpoint), or start a new run")


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
        hint = " (an unfinished save: use an earlier checkpoint)" if ckpt.name.startswith(TMP_PREFIX) else ""
        raise CheckpointError(
            f"no checkpoint at {ckpt}: {MANIFEST} is missing{hint}; pass a step_<N> directory written by "
            "megatron-dapo (or a checkpoints root with a 'latest' file)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deeply
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
        for k in ARCH_FIELDS
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
    match = STEP_RE.match(Path(path).name)
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
        # Bytes that are not UTF-8 (a torn or foreign write) name no step: the pointer is stale.
        name = pointer.read_bytes()[:4096].decode("utf-8", "replace").strip()
        target = root / name
        if STEP_RE.match(name) and (target / MANIFEST).is_file():
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
