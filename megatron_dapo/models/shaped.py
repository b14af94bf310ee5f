"""Random HF checkpoints at a real model's shapes, with few layers: the flagship rehearsed on one machine.

Bugs that only appear at the flagship's shapes (8 KV heads over TP=8, a 152,064-row
vocabulary padded for TP=8, a 1.5 GB embedding larger than any weight-sync bucket, hub
checkpoints sharded in 4 GB files) need a checkpoint of those shapes. This writes one from
the model's published config.json (typed into examples/model_configs/, nothing downloaded)
with num_hidden_layers replaced: every tensor at its real shape and dtype (bf16), drawn
N(0, 0.02) (norm weights 1 + N(0, 0.02)), written a tensor at a time into hub-style shards
(models/hf_writer.py). A Qwen2.5-32B with 2 layers is 2.53 B parameters, 4.7 GiB.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.errors import UserError
from megatron_dapo.models.hf_writer import StreamingShardWriter, TensorSpec, hf_specs

STD = 0.02
"""Standard deviation of every weight (the models' initializer_range)."""
_ROWS_PER_DRAW = 1 << 14
"""Rows drawn per normal_() call: the generator's stream is the same however a tensor is cut."""


def shaped_config(published: dict[str, Any], num_layers: int, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The published config with ``num_layers`` layers (and test overrides such as a smaller width).

    Args:
        published: the model's config.json as published.
        num_layers: num_hidden_layers of the rehearsal model.
        overrides: config fields to replace (tests shrink hidden_size / vocab_size).

    Returns:
        The config.json to write.
    """
    if num_layers < 1:
        raise UserError(f"--layers {num_layers} must be at least 1")
    config = dict(published)
    config.update(overrides or {})
    config["num_hidden_layers"] = num_layers
    for key in ("max_window_layers",):
        if key in config:
            config[key] = min(int(config[key]), num_layers)
    if isinstance(config.get("mlp_only_layers"), list):
        config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < num_layers]
    return config


def write_shaped_checkpoint(
    out: str | Path, config: dict[str, Any], *, max_shard_bytes: int, seed: int = 0
) -> list[Path]:
    """Write config.json and random bf16 weights of ``config``'s exact shapes into new directory ``out``.

    Args:
        out: directory to create (must not exist or be empty).
        config: the config.json to write (see shaped_config).
        max_shard_bytes: largest safetensors shard, as the hub's (e.g. 4 GB).
        seed: generator seed; the same seed writes the same weights.

    Returns:
        The shard files.
    """
    from megatron_dapo.models import adapter_for

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"output directory {out} exists and is not empty; pass a new --out directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    specs: list[TensorSpec] = hf_specs(adapter_for(out).hf, torch.bfloat16)
    writer = StreamingShardWriter(out, specs, max_shard_bytes)
    generator = torch.Generator().manual_seed(seed)
    try:
        for spec in specs:
            tensor = torch.empty(spec.shape, dtype=spec.dtype)
            rows = tensor.view(-1, spec.shape[-1]) if tensor.dim() > 1 else tensor.view(1, -1)
            for start in range(0, rows.shape[0], _ROWS_PER_DRAW):
                rows[start : start + _ROWS_PER_DRAW].normal_(0.0, STD, generator=generator)
            if spec.name.endswith("norm.weight") or spec.name.endswith("layernorm.weight"):
                tensor += 1.0
            writer.write(spec.name, tensor)
            del tensor, rows
        return writer.finish()
    except BaseException:
        writer.abort()
        raise
