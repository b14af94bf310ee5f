"""What a LoRA run saves, loads and exports: its adapters, their sharding, the base they adapt.

Checkpoints. A LoRA actor's model state is its adapters alone: the base is frozen and
comes from its HF directory, named in the manifest with a fingerprint (``base_identity``), so
a resume on another base is refused in one line instead of training adapters against
weights they were not made for. ``sharded_state_dict`` describes each adapter tensor as
megatron's dist_checkpointing wants it (global key with the global layer and expert
number, this rank's fragment along the TP axis it is split on, the replica that writes
it), so a checkpoint loads at another TP/PP/DP layout like the full model's, and the
distributed optimizer finds its state by the same parameters.

Exports. ``merged_params`` is the stage's parameters as the engines need them: each adapted
weight's shard replaced by ``W + (alpha/r) B A`` of that shard (no communication: B and A are
split so that each shard's product is that shard of the full product), computed in float32
and cast to the weight's dtype when read, one tensor at a time, so the export streams as a
full model's does and the base weights are never written to.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.lora.layers import LoraModel, LoraSite, is_lora_param

__all__ = ["MergedParams", "base_identity", "export_params", "load_state", "sharded_state_dict"]

_EDGE_BYTES = 1 << 20


def sharded_state_dict(lora: LoraModel) -> dict[str, Any]:
    """{local parameter name: ShardedTensor} of every adapter tensor of this stage."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    dp = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    edp = parallel_state.get_expert_data_parallel_rank() if any(s.expert for s in lora.sites) else 0
    out: dict[str, Any] = {}
    for s in lora.sites:
        replica = edp if s.expert else dp
        for name, axis in (("lora_A", None if s.kind == "column" else 1),
                           ("lora_B", (1 if s.gated else 0) if s.kind == "column" else None)):
            param = getattr(s.module, name)
            key = f"{s.global_path}.{name}"
            if axis is None or s.tp == 1:  # replicated over TP: one TP rank writes it
                st = ShardedTensor.from_rank_offsets(key, param, replica_id=(0, s.tp_rank, replica))
            else:
                st = ShardedTensor.from_rank_offsets(key, param, (axis, s.tp_rank, s.tp), replica_id=(0, 0, replica))
            out[f"{s.path}.{name}"] = st
    return out


def load_state(lora: LoraModel, loaded: Mapping[str, torch.Tensor]) -> None:
    """Copy loaded adapter tensors (``sharded_state_dict``'s keys) into the adapters, strictly."""
    expected = {name for name, _ in lora.params()}
    missing, extra = sorted(expected - set(loaded)), sorted(set(loaded) - expected)
    if missing or extra:
        raise ValueError(f"the LoRA state does not match the model's adapters: missing {missing[:4]}, "
                         f"unexpected {extra[:4]}")
    with torch.no_grad():
        for name, param in lora.params():
            param.copy_(loaded[name])


class MergedParams(Mapping[str, torch.Tensor]):
    """A stage's base parameters by name, adapted weights read as ``W + scale B A`` (lazily)."""

    def __init__(self, gpt: Any, lora: LoraModel) -> None:
        self._params = {n: p for n, p in gpt.named_parameters() if not is_lora_param(n)}
        self._lora = lora
        self.base: Mapping[str, torch.Tensor] = self._params
        """The base parameters as they are: shapes and dtypes (the merged ones have W's) without merging."""

    def __getitem__(self, name: str) -> torch.Tensor:
        param = self._params[name]
        site: LoraSite | None = self._lora.site_of_weight(name)
        if site is None or not self._lora.enabled:
            return param
        return site.merged(param, self._lora.scale)

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def export_params(gpt: Any) -> Mapping[str, torch.Tensor]:
    """The parameters an HF export reads: the model's own, or merged ones for a LoRA model."""
    from megatron_dapo.lora.layers import lora_of

    lora = lora_of(gpt)
    if lora is None:
        return dict(gpt.named_parameters())
    return MergedParams(gpt, lora)


def base_identity(hf_dir: str | Path) -> dict[str, Any]:
    """The base an adapter checkpoint belongs to: its directory and a fingerprint of its weights.

    The fingerprint hashes config.json and, for each weight file, its name, size and first and
    last MiB (the safetensors header with every name, shape and offset, and tensor bytes at both
    ends): another model, another size or a fine-tuned copy differ there, and a 61 GB base is
    fingerprinted in milliseconds. It names the base; it is not an integrity check of it.
    """
    root = Path(hf_dir)
    digest = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        digest.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    files = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_EDGE_BYTES))
            if size > _EDGE_BYTES:
                f.seek(max(_EDGE_BYTES, size - _EDGE_BYTES))
                digest.update(f.read())
    return {"path": str(root.resolve()), "fingerprint": digest.hexdigest()}
