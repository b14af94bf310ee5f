"""A weight bucket as one flat tensor per dtype: SGLang's ``load_format="flattened_bucket"``.

Step 7 of the RL step sends buckets of full HF tensors to colocated SGLang engines through
CUDA IPC. Sent tensor by tensor, every tensor is its own IPC handle, which every TP worker
of the engine opens, maps and closes: at 32B about 770 tensors x 8 workers per sync. The
flattened format (SGLang >= 0.5.1, ``sglang/srt/weight_sync/tensor_bucket.py``; slime's
colocated sync uses it) copies a bucket's tensors of one dtype into one contiguous buffer
and sends that buffer's single handle plus, per tensor, its name, shape, dtype and element
range. The worker rebuilds views into the buffer and loads them as usual.

Wire format, read in the sglang 0.5.2, 0.5.12, 0.5.18 and 0.5.23 wheels (the server's
``_update_weights_from_flattened_bucket``): one serialized ``{"flattened_tensor": Tensor,
"metadata": [FlattenedTensorMetadata, ...]}`` per TP rank, each metadata with ``name, shape,
dtype, start_idx, end_idx, numel``; the worker takes ``flattened_tensor[start_idx:end_idx]``
and reshapes it to ``shape``. 0.5.2 reshapes without a dtype view, so one buffer holds one
dtype; 0.5.12 and later flatten to bytes themselves but view the slice as ``dtype`` first,
a no-op on a buffer of that dtype with element offsets. One typed buffer per dtype with
element offsets therefore reads the same in every release we allow. The metadata must be
sglang's own class: the server unpickles with an allowlist from 0.5.12 on (plain pickle in
0.5.2), and the allowlist names that class.

Aliases (two names for one tensor, e.g. tied embeddings) are stored once; both entries
point at the same range. The copy costs one extra bucket of memory while it is sent.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "FLATTENED_BUCKET",
    "FlatBucket",
    "FlatEntry",
    "WeightFormat",
    "WeightPayload",
    "default_weight_format",
    "encode_bucket",
    "flatten_by_dtype",
    "payload_tensors",
    "to_sglang_wire",
    "unflatten",
]

FLATTENED_BUCKET = "flattened_bucket"
"""SGLang's load_format name of the flattened format."""

WeightFormat = Literal["flattened_bucket", "tensors"]
"""How a bucket travels: one flat buffer per dtype, or one IPC handle per tensor."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatEntry:
    """Where one named tensor lies in a flat buffer (the fields of SGLang's FlattenedTensorMetadata)."""

    name: str
    """HF name of the tensor."""
    shape: torch.Size
    """Its shape."""
    dtype: torch.dtype
    """Its dtype (the buffer's)."""
    start_idx: int
    """First element in the buffer."""
    end_idx: int
    """One past its last element."""
    numel: int
    """end_idx - start_idx."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatBucket:
    """The tensors of one dtype of a bucket, copied into one 1-D buffer."""

    tensor: torch.Tensor
    """[total elements] of one dtype, on the device of the bucket's tensors."""
    entries: tuple[FlatEntry, ...]
    """One per name, in bucket order; aliased names share a range."""


WeightPayload = FlatBucket | list[tuple[str, torch.Tensor]]
"""What one request serializes: a flat buffer, or a list of (name, tensor) for per-tensor handles."""


def flatten_by_dtype(bucket: Sequence[tuple[str, torch.Tensor]]) -> list[FlatBucket]:
    """Copy a bucket into one flat buffer per dtype (dtypes in order of first appearance).

    Args:
        bucket: (name, tensor) pairs, any shapes, strides and dtypes, all on one device.

    Returns:
        One FlatBucket per dtype; each tensor's elements are copied once, in row-major order.
    """
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in bucket:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    return [_flatten_one_dtype(group) for group in by_dtype.values()]


def _flatten_one_dtype(group: list[tuple[str, torch.Tensor]]) -> FlatBucket:
    entries: list[FlatEntry] = []
    sources: list[tuple[int, torch.Tensor]] = []  # (start in the buffer, tensor to copy)
    seen: dict[tuple[Any, ...], tuple[int, int]] = {}
    offset = 0
    for name, tensor in group:
        # The same memory viewed the same way is one tensor under two names (tied weights).
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()))  # fmt: skip
        if tensor.numel() and key in seen:
            start, end = seen[key]
        else:
            start, end = offset, offset + tensor.numel()
            seen[key] = (start, end)
            sources.append((start, tensor))
            offset = end
        entries.append(FlatEntry(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=start, end_idx=end,
                                 numel=end - start))
    first = group[0][1]
    flat = torch.empty(offset, dtype=first.dtype, device=first.device)
    for start, tensor in sources:
        # One copy straight into place, whatever the source's strides.
        flat[start : start + tensor.numel()].view(tensor.shape).copy_(tensor)
    return FlatBucket(tensor=flat, entries=tuple(entries))


def unflatten(flat: FlatBucket) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a flat buffer, as views into it (what SGLang's worker rebuilds).

    Args:
        flat: from :func:`flatten_by_dtype` (or decoded from the wire).

    Returns:
        (name, tensor) in bucket order; aliased names share memory.
    """
    return [(e.name, flat.tensor[e.start_idx : e.end_idx].view(e.dtype).reshape(e.shape)) for e in flat.entries]


def default_weight_format() -> WeightFormat:
    """The flattened format where the installed sglang has it (>= 0.5.1), else per-tensor handles.

    The trainer serializes with the sglang it imports, which is the server's install for
    colocated engines; releases before 0.5.1 have no ``sglang.srt.weight_sync.tensor_bucket``.
    """
    try:
        found = importlib.util.find_spec("sglang.srt.weight_sync.tensor_bucket") is not None
    except ImportError:  # sglang (or sglang.srt) itself is missing
        found = False
    return FLATTENED_BUCKET if found else "tensors"


def encode_bucket(
    bucket: Sequence[tuple[str, torch.Tensor]], weight_format: WeightFormat
) -> list[tuple[str | None, WeightPayload]]:
    """The requests that load one bucket: (load_format, payload) each.

    Args:
        bucket: (name, full tensor) pairs.
        weight_format: "flattened_bucket" (one request per dtype) or "tensors" (one request).

    Returns:
        Requests in order; every TP rank of an engine serializes each payload once.
    """
    if weight_format == FLATTENED_BUCKET:
        return [(FLATTENED_BUCKET, flat) for flat in flatten_by_dtype(bucket)]
    return [(None, list(bucket))]


def payload_tensors(payload: WeightPayload) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs whose memory a payload shares: the flat buffer, or each tensor."""
    if isinstance(payload, FlatBucket):
        return [(payload.entries[0].name if payload.entries else "<empty>", payload.tensor)]
    return payload


def to_sglang_wire(payload: WeightPayload) -> Any:
    """The object SGLang's worker unpickles: its flattened-bucket dict, or the list of pairs.

    The metadata is converted to sglang's FlattenedTensorMetadata, the class its
    deserializer allows (our FlatEntry would be refused from 0.5.12 on).
    """
    if not isinstance(payload, FlatBucket):
        return list(payload)
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    metadata = [FlattenedTensorMetadata(name=e.name, shape=e.shape, dtype=e.dtype, start_idx=e.start_idx,
                                        end_idx=e.end_idx, numel=e.numel) for e in payload.entries]
    return {"flattened_tensor": payload.tensor, "metadata": metadata}
