"""Checkpoints that load under either of megatron's layer specs: the local one and Transformer Engine's.

A torch_dist checkpoint names its tensors by the sharded keys of the spec that wrote it, and
megatron-core 0.16.1's two GPT layer specs name the same weights differently
(models/gpt/gpt_layer_specs.py, extensions/transformer_engine.py, read 2026-11-27):

- the local spec maps ``input_layernorm.`` to ``self_attention.linear_qkv.layer_norm_`` and
  ``pre_mlp_layernorm.`` to ``mlp.linear_fc1.layer_norm_`` for every layer, MoE layers included;
  the TE spec fuses those norms into TELayerNormColumnParallelLinear (same names) except an MoE
  layer's, a TENorm of its own saved as ``pre_mlp_layernorm.weight``;
- TE modules add ``_extra_state`` ShardedObjects (their FP8 metadata): linear_qkv, linear_proj,
  a dense MLP's linear_fc1/fc2, every TENorm (q/k norms, an MoE layer's pre-MLP norm, the final
  norm) and each grouped expert's linear_fc1/fc2 (key ``...mlp.experts.experts.linear_fc1._extra_state``,
  shape [layers, experts]); TE's core attention saves none (softmax_type "vanilla"). Without FP8
  they hold an empty uint8 tensor (TE >= 2.9; TE 2.8 pickles an empty dict for its norms).
  megatron's local linears save one as well (None, "compatibility with TE state dict",
  tensor_parallel/layers.py); its norms do not, so a local checkpoint lacks the TENorms' ones;
- TEGroupedMLP's expert weights are keyed as SequentialMLP's ("interchangeable", experts.py).

So a TE run's Qwen3-MoE checkpoint lacks what the local spec asks for (``mlp.linear_fc1.
layer_norm_weight`` of MoE layers), and a local checkpoint lacks what a TE run asks for (the
extra state, the MoE pre-MLP norm): megatron's load raised on either. Before a load, the request
is aligned with what the checkpoint holds (:func:`align_to_checkpoint`): a tensor the checkpoint
holds under the other spec's name is read from there; an ``_extra_state`` it lacks keeps the
module's own (set back after the load, :func:`restore_kept`); extra state the request lacks is
never read (megatron's default strictness ignores unrequested keys). Saving is unchanged: each
spec writes its own names, and either spec reads both. The optimizer's state is keyed by the
model's keys (fully_reshardable), so the same renaming covers it; dp_reshardable buffers follow
the parameter order, which differs between the specs, and are refused across them by the
manifest's ``layer_spec`` (checkpoint/manager.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SPEC_ALIASES", "StoredIndex", "align_to_checkpoint", "layer_spec_of", "restore_kept"]

SPEC_ALIASES: tuple[tuple[str, str], ...] = (
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
)
"""(one spec's name part, the other's) for the same tensor; tried in both directions."""

EXTRA_STATE = "_extra_state"


@dataclass
class StoredIndex:
    """What a torch_dist checkpoint holds: tensor keys with their chunks, and ShardedObject names."""

    tensors: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = field(default_factory=dict)
    """Global tensor key -> [(offsets, sizes)] of its stored chunks."""
    objects: set[str] = field(default_factory=set)
    """Stored ShardedObjects by megatron's unique key (``<key>/shard_<offsets>_<shape>``)."""

    @classmethod
    def from_metadata(cls, metadata: Any) -> StoredIndex:
        """From the torch.distributed.checkpoint Metadata of ``.metadata`` (format.py reads it safely)."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        index = cls()
        for key, info in metadata.state_dict_metadata.items():
            if isinstance(info, BytesStorageMetadata):
                index.objects.add(key)
            else:
                index.tensors[key] = [(tuple(c.offsets), tuple(c.sizes)) for c in info.chunks]
        return index

    def covers(self, sharded: Any, key: str | None = None) -> bool:
        """Whether some stored chunk of ``key`` (default the tensor's own) overlaps what ``sharded`` asks for."""
        chunks = self.tensors.get(sharded.key if key is None else key)
        if chunks is None:
            return False
        lo = tuple(getattr(sharded, "global_offset", ()) or ())
        if not lo:
            return True
        size = (1,) * int(getattr(sharded, "prepend_axis_num", 0)) + tuple(getattr(sharded, "local_shape", ()) or ())
        for offsets, sizes in chunks:
            if len(offsets) != len(lo):
                return True  # another rank count of the layout; the load's own checks decide
            if all(a < c + s and c < a + n for a, n, c, s in zip(lo, size, offsets, sizes, strict=False)):
                return True
        return False


@dataclass
class Kept:
    """An ``_extra_state`` left out of the load: where it sits in the request and the module's own value."""

    path: tuple[Any, ...]
    value: Any


def align_to_checkpoint(state: dict[str, Any], stored: StoredIndex) -> tuple[list[str], list[Kept]]:
    """Rename and trim a sharded state dict (model and optimizer) in place to what the checkpoint holds.

    Args:
        state: the request for dist_checkpointing.load (ShardedTensors, factories, ShardedObjects).
        stored: the checkpoint's index.

    Returns:
        (what was renamed, as "old -> new" lines; the extra states kept out of the load).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    renamed: list[str] = []
    kept: list[Kept] = []
    for path, item in list(_leaves(state)):
        if isinstance(item, ShardedTensor | ShardedTensorFactory):
            if item.key in stored.tensors and (isinstance(item, ShardedTensorFactory) or stored.covers(item)):
                continue
            for alias in _aliases(item.key):
                found = alias in stored.tensors if isinstance(item, ShardedTensorFactory) else stored.covers(item, alias)
                if found:
                    renamed.append(f"{item.key} -> {alias}")
                    item.key = alias
                    break
        elif (isinstance(item, ShardedObject) and item.key.endswith(EXTRA_STATE)
              and item.unique_key not in stored.objects and isinstance(_parent(state, path), dict)):
            kept.append(Kept(path, item.data))
            _remove(state, path)
    return renamed, kept


def restore_kept(loaded: dict[str, Any], kept: list[Kept]) -> None:
    """Put each kept extra state back where the load's result has it (the module keeps its own)."""
    for entry in kept:
        _parent(loaded, entry.path)[entry.path[-1]] = entry.value


def layer_spec_of(model: torch.nn.Module) -> str:
    """"te" when any module of the (unwrapped) model comes from Transformer Engine, else "local"."""
    for module in model.modules():
        name = type(module).__module__
        if name.startswith("transformer_engine") or name == "megatron.core.extensions.transformer_engine":
            return "te"
    return "local"


def _aliases(key: str) -> Iterator[str]:
    for a, b in SPEC_ALIASES:
        for old, new in ((a, b), (b, a)):
            if old in key:
                yield key.replace(old, new, 1)


def _leaves(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*path, i))
    else:
        yield path, tree


def _parent(tree: Any, path: tuple[Any, ...]) -> Any:
    for part in path[:-1]:
        tree = tree[part]
    return tree


def _remove(tree: Any, path: tuple[Any, ...]) -> None:
    del _parent(tree, path)[path[-1]]
