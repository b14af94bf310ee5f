"""Checksums of every file of a checkpoint, written into its manifest and checked on load.

A flipped byte in tensor data loads (and converts to HF) without any error: the torch_dist
format has no checksums of its own. At save, the files of the checkpoint directory
(everything but manifest.json) are split over the ranks, each rank CRC32s its share, and
rank 0 records the union in the manifest as ``checksums: {relative path: "crc32:<hex>"}``.
On load the same split verifies them in parallel, so a resume of a large checkpoint reads
each byte once more, spread over all ranks, not all of it on rank 0. Checkpoints written
before this (no ``checksums`` key) load unchecked.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_dapo.checkpoint.files import MANIFEST, CheckpointError

_CHUNK_BYTES = 16 << 20


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _rank_and_size() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def checksum_tree(root: Path) -> dict[str, str]:
    """Checksums of every file under ``root`` but the manifest (collective; the same dict on every rank)."""
    rank, size = _rank_and_size()
    names = _files(root)
    mine = {name: _crc32(root / name) for i, name in enumerate(names) if i % size == rank}
    if size == 1:
        return mine
    parts: list[Any] = [None] * size
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def verify_checksums(ckpt: Path, manifest: dict[str, Any]) -> None:
    """Compare the files of ``ckpt`` with the manifest's checksums (collective).

    Raises:
        CheckpointError: on every rank, naming the first file that is missing or differs.
    """
    expected: dict[str, str] | None = manifest.get("checksums")
    if not expected:
        return
    rank, size = _rank_and_size()
    problems = []
    for i, name in enumerate(sorted(expected)):
        if i % size != rank:
            continue
        path = ckpt / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif _crc32(path) != expected[name]:
            problems.append(f"{name} does not match its checksum (corrupted on disk or in a copy)")
    if size > 1:
        parts: list[Any] = [None] * size
        dist.all_gather_object(parts, problems)
        problems = [p for part in parts for p in part]
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {ckpt}: {sorted(problems)[0]}{more}; use an earlier checkpoint "
                              "or copy this one again")
