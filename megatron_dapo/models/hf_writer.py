"""Write an HF checkpoint's safetensors shards as a stream: one tensor in memory at a time.

The exporter (mcore -> HF) and the shaped-checkpoint tool know every tensor's name,
shape and dtype before the first byte is written, so the shards are planned up front
(filled in order up to ``max_shard_bytes``, hub style: a tensor larger than the limit
gets a shard of its own), each file's header is written at once, and each tensor is
written at its planned offset when it arrives, in any order. Holding a shard until it
fills (the old writer) cost up to max_shard_size (5 GB) of memory per conversion.
Files are written under temporary names and renamed (with the index) only when every
planned tensor arrived, so an interrupted export leaves no shard that looks complete.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from megatron_dapo.checkpoint.files import chmod_as_created
from megatron_dapo.models.config import HFModelConfig
from megatron_dapo.models.mapping import expected_hf_shapes

INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor the checkpoint will hold."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def hf_specs(hf: HFModelConfig, dtype: torch.dtype) -> list[TensorSpec]:
    """Every HF tensor of the model in hub order (embeddings, layers, final norm, lm_head) and ``dtype``."""
    shapes = expected_hf_shapes(hf)
    last = [n for n in ("model.norm.weight", "lm_head.weight") if n in shapes]
    order = [n for n in shapes if n not in last] + last
    return [TensorSpec(n, shapes[n], dtype) for n in order]


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors, in order, into shards of at most ``max_shard_bytes`` (a larger tensor alone).

    Args:
        specs: every tensor, in the order they should appear.
        max_shard_bytes: largest shard's data size.

    Returns:
        One list of specs per shard, at least one shard.
    """
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


class StreamingShardWriter:
    """Safetensors shards with headers written up front and tensors written as they come.

    Args:
        out: existing output directory.
        specs: every tensor the checkpoint holds, in shard order.
        max_shard_bytes: largest shard's data size.
    """

    def __init__(self, out: Path, specs: Sequence[TensorSpec], max_shard_bytes: int) -> None:
        self.out = Path(out)
        plan = plan_shards(specs, max_shard_bytes)
        total = len(plan)
        self.names = ["model.safetensors"] if total == 1 else [
            f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)]
        self.total_bytes = sum(s.nbytes for s in specs)
        self._where: dict[str, tuple[int, int, TensorSpec]] = {}  # name -> (shard, absolute offset, spec)
        self._files: list[BinaryIO] = []
        self._pending = {s.name for s in specs}
        for index, shard in enumerate(plan):
            header: dict[str, object] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for spec in shard:
                header[spec.name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                                     "data_offsets": [offset, offset + spec.nbytes]}
                offset += spec.nbytes
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
            path = self._tmp(index)
            f = open(path, "wb")  # noqa: SIM115 - open until finish() renames it
            chmod_as_created(path)
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(8 + len(text) + offset)
            self._files.append(f)
            base = 8 + len(text)
            start = 0
            for spec in shard:
                self._where[spec.name] = (index, base + start, spec)
                start += spec.nbytes

    def _tmp(self, index: int) -> Path:
        return self.out / f".tmp-{self.names[index]}"

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one planned tensor (any order); it may be a view, it is not kept."""
        if name not in self._where:
            raise ValueError(f"tensor {name!r} is not in the planned checkpoint")
        index, offset, spec = self._where[name]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, planned {spec.shape} {spec.dtype}")
        data = tensor.detach().to("cpu").contiguous()
        f = self._files[index]
        f.seek(offset)
        if data.numel():
            f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self._pending.discard(name)

    def finish(self) -> list[Path]:
        """Check every tensor arrived, name the shards HF-style and write the index."""
        if self._pending:
            missing = sorted(self._pending)
            raise ValueError(f"{len(missing)} planned tensors were never written, e.g. {missing[:4]}")
        weight_map: dict[str, str] = {}
        final = []
        for index, f in enumerate(self._files):
            f.flush()
            os.fsync(f.fileno())
            f.close()
            path = self.out / self.names[index]
            os.replace(self._tmp(index), path)
            final.append(path)
        for name, (index, _, _) in self._where.items():
            weight_map[name] = self.names[index]
        index_doc = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_FILE).write_text(json.dumps(index_doc, indent=2) + "\n")
        chmod_as_created(self.out / INDEX_FILE)
        return final

    def abort(self) -> None:
        """Close and delete the unfinished shards."""
        for index, f in enumerate(self._files):
            f.close()
            self._tmp(index).unlink(missing_ok=True)
        self._files = []
