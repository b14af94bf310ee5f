"""Checkpoint directory names, the error type, and durable file writes (fsync + atomic rename).

A file of a checkpoint is durable before the checkpoint is published: the rename that
publishes a directory must never reach the disk before the data it points to.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from megatron_dapo.errors import UserError

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

STEP_RE = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
"""Names starting with it are unfinished work; the next save deletes them."""
# Weights are ours to write; only the config and tokenizer files travel with a checkpoint.
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
# What must agree between a checkpoint and the model loading it (TransformerConfig + GPTModel).
ARCH_FIELDS = (
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


def process_rank() -> int:
    """Global rank, 0 without a process group (single-process tools and tests)."""
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    """Wait for every rank; a no-op without a process group."""
    if dist.is_initialized():
        dist.barrier()


def fsync_dir(path: Path) -> None:
    """Make a rename/creation inside ``path`` durable (a crash right after could lose it otherwise)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def current_umask() -> int:
    """The process umask, read without changing it (os.umask can only be read by setting it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def chmod_as_created(path: str | os.PathLike[str], directory: bool = False) -> None:
    """Give ``path`` the mode a plain open()/mkdir() would: safetensors' save_file and
    mkstemp/mkdtemp create 0600/0700, which other users of a shared model directory cannot read."""
    os.chmod(path, (0o777 if directory else 0o666) & ~current_umask())


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``: dist_checkpointing does not, and the rename
    that publishes the checkpoint must not become durable before its content."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


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
    except (ValueError, RecursionError, AttributeError) as e:  # not JSON, nested too deeply, not an object
        raise CheckpointError(
            f"{src / 'config.json'} is not valid JSON ({e}); fix or re-download the HF checkpoint"
        ) from None


def hf_files_of(path: str | os.PathLike[str]) -> Path | None:
    """A checkpoint's embedded ``hf/`` directory, or None if it has none."""
    hf = Path(path) / HF_DIR
    return hf if (hf / "config.json").is_file() else None
