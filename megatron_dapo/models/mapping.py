"""HF <-> Megatron-Core tensor layout for Llama-style decoders (Qwen2/Qwen2.5, Llama).

One :class:`TensorMap` says how one Megatron parameter is made of HF tensors, and the
functions here cut the local TP shard out of the HF tensors (load) or rebuild the HF
tensors from all TP shards (export). Layouts that differ from HF:

- ``linear_qkv`` is grouped by query group: for each KV head g, [q heads of g; k_g; v_g],
  and TP rank r holds the contiguous groups [r*G/tp, (r+1)*G/tp) (G = num KV heads);
- ``linear_fc1`` is [gate; up] *per TP shard*, i.e. rank r holds
  [gate[r*F/tp:(r+1)*F/tp]; up[r*F/tp:(r+1)*F/tp]];
- ``linear_proj`` and ``linear_fc2`` are row-parallel: split along the input dim (dim 1);
- embeddings and the output layer hold Vp/tp rows of the vocab padded to Vp (rows >= V
  are zeros on load and dropped on export).
Layernorm weights are replicated. The Transformer Engine spec stores the two per-layer
norms inside linear_qkv / linear_fc1 (``layer_norm_weight``); both namings are mapped.

Mixture-of-experts layers (Qwen3-MoE) add the router (``mlp.router.weight`` <->
``mlp.gate.weight``, [E, H], replicated), QK-norm weights ([d], replicated) and the experts.
An expert's fc1/fc2 are sharded like a dense MLP's, but over the expert tensor-parallel
group (ETP), and each expert lives on one expert-parallel (EP) rank: rank r holds experts
[r*E/ep, (r+1)*E/ep) as local experts 0..E/ep-1. The local spec (SequentialMLP) names them
``mlp.experts.local_experts.{j}.linear_fc1.weight``, the TE spec (TEGroupedMLP)
``mlp.experts.linear_fc1.weight{j}``; both are mapped. HF stores one tensor per expert and
projection (``mlp.experts.{e}.gate_proj.weight`` ...), so an expert is exported alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_dapo.errors import UserError
from megatron_dapo.models.config import HFModelConfig
from megatron_dapo.models.hf_checkpoint import HFCheckpoint

KINDS = ("replicated", "vocab", "row", "qkv", "fc1", "expert_fc1", "expert_row")

_LAYER_PATTERNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # (megatron suffix regex, kind, HF names relative to model.layers.{i}.)
    (
        r"input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight",
        "replicated",
        ("input_layernorm.weight",),
    ),
    (
        r"pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight",
        "replicated",
        ("post_attention_layernorm.weight",),
    ),
    (
        r"self_attention\.linear_qkv\.weight",
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    (
        r"self_attention\.linear_qkv\.bias",
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    (r"self_attention\.linear_proj\.weight", "row", ("self_attn.o_proj.weight",)),
    (r"mlp\.linear_fc1\.weight", "fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    (r"mlp\.linear_fc2\.weight", "row", ("mlp.down_proj.weight",)),
    (r"self_attention\.q_layernorm\.weight", "replicated", ("self_attn.q_norm.weight",)),
    (r"self_attention\.k_layernorm\.weight", "replicated", ("self_attn.k_norm.weight",)),
    (r"mlp\.router\.weight", "replicated", ("mlp.gate.weight",)),
)
_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(
    r"mlp\.experts\.(?:local_experts\.(?P<seq>\d+)\.linear_(?P<fc>fc1|fc2)\.weight"
    r"|linear_(?P<gfc>fc1|fc2)\.weight(?P<grouped>\d+))"
)
_EXPERT_POSITION = len(_LAYER_PATTERNS)
"""Experts come after every other tensor of their layer in the export order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorMap:
    """How one local Megatron parameter relates to HF tensors."""

    mcore_name: str
    """Parameter name in the unwrapped GPTModel of this pipeline stage."""
    hf_names: tuple[str, ...]
    """HF tensors it is made of (3 for qkv, 2 for fc1, else 1)."""
    kind: str
    """One of KINDS: how it is sharded over TP and fused."""
    sort_key: tuple[int, ...]
    """(global position, index in layer[, expert, projection]): orders exports identically on every stage."""
    mirror: bool = False
    """True for the last stage's copy of tied embeddings: loaded, never exported."""
    expert: int | None = None
    """Global expert index for an expert's fc1/fc2 (held by one EP rank); None otherwise."""


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocab: the next multiple of ``divisible_by * tp``.

    Args:
        vocab_size: HF vocab_size.
        tp: tensor-parallel size.
        divisible_by: make_vocab_size_divisible_by.

    Returns:
        Vp >= vocab_size, divisible by divisible_by * tp.
    """
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def expected_hf_shapes(hf: HFModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config must hold, with its shape.

    Args:
        hf: parsed HF config.

    Returns:
        HF name -> shape (lm_head.weight only when embeddings are untied).
    """
    h, d, f = hf.hidden_size, hf.head_dim, hf.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (hf.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not hf.tie_word_embeddings:
        shapes["lm_head.weight"] = (hf.vocab_size, h)
    for i in range(hf.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (hf.num_attention_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (hf.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (hf.num_kv_heads * d, h)
        if hf.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (hf.num_attention_heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (hf.num_kv_heads * d,)
            shapes[p + "self_attn.v_proj.bias"] = (hf.num_kv_heads * d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, hf.num_attention_heads * d)
        if hf.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if i in hf.moe_layers:
            shapes[p + "mlp.gate.weight"] = (hf.num_experts, h)
            for e in range(hf.num_experts):
                for name, shape in expert_shapes(hf).items():
                    shapes[f"{p}mlp.experts.{e}.{name}"] = shape
            continue
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    return shapes


def expert_shapes(hf: HFModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensors of one expert (names relative to ``model.layers.{i}.mlp.experts.{e}.``)."""
    h, f = hf.hidden_size, hf.moe_intermediate_size
    return {"gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f)}


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
"""safetensors dtype names a weight may be stored in."""
_STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def check_checkpoint(hf: HFModelConfig, ckpt: HFCheckpoint) -> None:
    """Compare the checkpoint's tensors with what config.json implies; raise once, listing all differences.

    Tolerated extras: ``lm_head.weight`` when embeddings are tied (some exporters write
    it) and legacy ``rotary_emb.inv_freq`` buffers.
    """
    expected = expected_hf_shapes(hf)
    found = ckpt.shapes
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(
        name
        for name in set(found) - set(expected)
        if not name.endswith("rotary_emb.inv_freq")
        and not (hf.tie_word_embeddings and name == "lm_head.weight")
    )
    wrong = sorted(
        f"{name} {tuple(found[name])} != {expected[name]}"
        for name in set(expected) & set(found)
        if tuple(found[name]) != expected[name]
    )
    # Integer or bool "weights" would be cast to floats silently: the file is not these weights.
    dtypes = ckpt.dtypes
    not_float = sorted(f"{name} {dtypes[name]}" for name in set(expected) & set(found)
                       if dtypes[name] not in FLOAT_DTYPES)
    if missing or unexpected or wrong or not_float:
        problems = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", wrong),
                             (f"not floating point ({'/'.join(FLOAT_DTYPES)})", not_float)):
            if items:
                shown = ", ".join(items[:8]) + (f" (+{len(items) - 8} more)" if len(items) > 8 else "")
                problems.append(f"{len(items)} {label}: {shown}")
        raise UserError(
            f"HF checkpoint {ckpt.directory} does not match its config.json ({hf.architecture}): "
            + "; ".join(problems)
            + "; the weights and config.json come from different models or the save was partial"
        )


def tensor_maps(
    named_params: list[tuple[str, torch.Tensor]], layer_numbers: dict[int, int], tied: bool,
    expert_offset: int = 0,
) -> list[TensorMap]:
    """Map every local Megatron parameter to HF names.

    Args:
        named_params: ``model.named_parameters()`` of the unwrapped GPTModel.
        layer_numbers: local layer index -> global 0-based layer index.
        tied: share_embeddings_and_output_weights.
        expert_offset: global index of this EP rank's local expert 0 (ep_rank * E / ep).

    Returns:
        One TensorMap per parameter, sorted in global export order.
    """
    maps: list[TensorMap] = []
    unknown: list[str] = []
    last = 1 << 30
    for name, _ in named_params:
        if name == "embedding.word_embeddings.weight":
            maps.append(
                TensorMap(
                    mcore_name=name, hf_names=("model.embed_tokens.weight",), kind="vocab", sort_key=(-1, 0)
                )
            )
        elif name == "decoder.final_layernorm.weight":
            maps.append(
                TensorMap(
                    mcore_name=name, hf_names=("model.norm.weight",), kind="replicated", sort_key=(last, 0)
                )
            )
        elif name == "output_layer.weight":
            hf_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
            maps.append(
                TensorMap(mcore_name=name, hf_names=(hf_name,), kind="vocab", sort_key=(last, 1), mirror=tied)
            )
        elif (match := _LAYER_RE.fullmatch(name)) is not None and (
            expert_match := _EXPERT_RE.fullmatch(match.group(2))
        ) is not None:
            layer = layer_numbers[int(match.group(1))]
            local = expert_match.group("seq") or expert_match.group("grouped")
            expert = expert_offset + int(local)
            fc = expert_match.group("fc") or expert_match.group("gfc")
            prefix = f"model.layers.{layer}.mlp.experts.{expert}."
            if fc == "fc1":
                maps.append(TensorMap(mcore_name=name, hf_names=(prefix + "gate_proj.weight", prefix + "up_proj.weight"),
                                      kind="expert_fc1", sort_key=(layer, _EXPERT_POSITION, expert, 0), expert=expert))
            else:
                maps.append(TensorMap(mcore_name=name, hf_names=(prefix + "down_proj.weight",), kind="expert_row",
                                      sort_key=(layer, _EXPERT_POSITION, expert, 1), expert=expert))
        elif (match := _LAYER_RE.fullmatch(name)) is not None:
            layer = layer_numbers[int(match.group(1))]
            for position, (pattern, kind, suffixes) in enumerate(_LAYER_PATTERNS):
                if re.fullmatch(pattern, match.group(2)):
                    hf_names = tuple(f"model.layers.{layer}.{s}" for s in suffixes)
                    maps.append(
                        TensorMap(mcore_name=name, hf_names=hf_names, kind=kind, sort_key=(layer, position))
                    )
                    break
            else:
                unknown.append(name)
        else:
            unknown.append(name)
    if unknown:
        raise UserError(
            f"Megatron parameters {unknown} have no HF counterpart; the model was built with options the "
            "adapter does not map (e.g. add_bias_linear or shared experts): build it with the adapter's "
            "transformer_config"
        )
    return sorted(maps, key=lambda m: m.sort_key)


def load_shard(
    tm: TensorMap, ckpt: HFCheckpoint, hf: HFModelConfig, tp: int, tp_rank: int, padded_vocab: int
) -> torch.Tensor:
    """Read exactly this TP rank's shard of one Megatron parameter from the checkpoint.

    Args:
        tm: the parameter's map.
        ckpt: open checkpoint.
        hf: parsed HF config.
        tp: tensor-parallel size.
        tp_rank: this rank's TP index.
        padded_vocab: Vp.

    Returns:
        The local shard in Megatron layout, e.g. qkv: [(nq + 2*nkv) * d / tp, H],
        fc1: [2 * F / tp, H], vocab: [Vp / tp, H]. For the expert kinds, tp and tp_rank
        are the expert tensor-parallel size and rank: expert_fc1 [2 * F_moe / etp, H],
        expert_row [H, F_moe / etp].
    """
    if tm.kind in ("expert_fc1", "expert_row"):
        return _load_expert_shard(tm, ckpt, tp, tp_rank)
    if tm.kind == "replicated":
        return ckpt.read(tm.hf_names[0])
    if tm.kind == "row":
        cols = ckpt.shapes[tm.hf_names[0]][1] // tp
        return ckpt.read(tm.hf_names[0], dim=1, start=tp_rank * cols, stop=(tp_rank + 1) * cols)
    if tm.kind == "vocab":
        rows = padded_vocab // tp
        start, stop = tp_rank * rows, (tp_rank + 1) * rows
        # Read straight into the padded shard: the embedding is the largest tensor, so no second copy.
        name = tm.hf_names[0]
        first, last = min(start, hf.vocab_size), min(stop, hf.vocab_size)
        shard = torch.zeros(rows, ckpt.shapes[name][1], dtype=_STORED_DTYPES[ckpt.dtypes[name]])
        ckpt.read(name, start=first, stop=last, out=shard[: last - first])
        return shard
    if tm.kind == "fc1":
        return _read_gate_up(tm, ckpt, hf.intermediate_size // tp, tp_rank)
    assert tm.kind == "qkv", tm.kind
    d = hf.head_dim
    num_groups = hf.num_kv_heads // tp
    heads_per_group = hf.num_attention_heads // hf.num_kv_heads
    g0, g1 = tp_rank * num_groups, (tp_rank + 1) * num_groups
    q = ckpt.read(tm.hf_names[0], start=g0 * heads_per_group * d, stop=g1 * heads_per_group * d)
    k = ckpt.read(tm.hf_names[1], start=g0 * d, stop=g1 * d)
    v = ckpt.read(tm.hf_names[2], start=g0 * d, stop=g1 * d)
    trailing = q.shape[1:]
    # [groups, (hpg + 2) * d, ...] -> [(nq + 2 * nkv) * d / tp, ...]
    fused = torch.cat(
        [
            q.reshape(num_groups, heads_per_group * d, *trailing),
            k.reshape(num_groups, d, *trailing),
            v.reshape(num_groups, d, *trailing),
        ],
        dim=1,
    )
    return fused.reshape(-1, *trailing)


def _load_expert_shard(tm: TensorMap, ckpt: HFCheckpoint, etp: int, etp_rank: int) -> torch.Tensor:
    """One expert's fc1 ([gate; up] rows of this ETP rank) or fc2 (its columns)."""
    if tm.kind == "expert_row":
        cols = ckpt.shapes[tm.hf_names[0]][1] // etp
        return ckpt.read(tm.hf_names[0], dim=1, start=etp_rank * cols, stop=(etp_rank + 1) * cols)
    return _read_gate_up(tm, ckpt, ckpt.shapes[tm.hf_names[0]][0] // etp, etp_rank)


def _read_gate_up(tm: TensorMap, ckpt: HFCheckpoint, rows: int, rank: int) -> torch.Tensor:
    """[gate rows of this rank; up rows of this rank], read straight into one buffer."""
    gate = tm.hf_names[0]
    fused = torch.empty(2 * rows, ckpt.shapes[gate][1], dtype=_STORED_DTYPES[ckpt.dtypes[gate]])
    for half, name in zip(fused.chunk(2, dim=0), tm.hf_names, strict=True):
        ckpt.read(name, start=rank * rows, stop=(rank + 1) * rows, out=half)
    return fused


def hf_from_shards(tm: TensorMap, shards: list[torch.Tensor], hf: HFModelConfig) -> list[torch.Tensor]:
    """Rebuild the HF tensors of one Megatron parameter from its TP shards (in TP rank order).

    Args:
        tm: the parameter's map.
        shards: every TP rank's local tensor (one element for replicated parameters).
        hf: parsed HF config.

    Returns:
        One full HF tensor per name in ``tm.hf_names``, same order.
    """
    if tm.kind == "replicated":
        return [shards[0]]
    if tm.kind in ("row", "expert_row"):
        return [_cat(shards, dim=1)]
    if tm.kind == "vocab":
        return [_cat(shards, dim=0)[: hf.vocab_size]]
    if tm.kind in ("fc1", "expert_fc1"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return [_cat([h[0] for h in halves], dim=0), _cat([h[1] for h in halves], dim=0)]
    assert tm.kind == "qkv", tm.kind
    d = hf.head_dim
    heads_per_group = hf.num_attention_heads // hf.num_kv_heads
    trailing = shards[0].shape[1:]
    # each shard: [groups_local * (hpg + 2) * d, ...] -> [G, (hpg + 2) * d, ...]
    grouped = torch.cat([s.reshape(-1, (heads_per_group + 2) * d, *trailing) for s in shards], dim=0)
    q, k, v = grouped.split([heads_per_group * d, d, d], dim=1)
    return [q.reshape(-1, *trailing), k.reshape(-1, *trailing), v.reshape(-1, *trailing)]


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat, except that one part is returned as it is (a view: no copy of a 1.5 GB embedding)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
