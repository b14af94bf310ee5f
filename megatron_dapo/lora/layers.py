"""Low-rank adapters on megatron-core's tensor-parallel linears, sharded the way each layer is.

A site is one linear of the GPTModel that gets an adapter: the layer's output becomes
``W x + (alpha / r) B A x`` with A [r, in] and B [out, r] (B = 0 at the start, as in the LoRA
paper, so the adapted model starts as the base). The adapter's parameters are the linear's own
``lora_A`` / ``lora_B``, so they follow the module through pipeline stages and experts, and a
forward hook adds the low-rank path to the linear's output; the base weight is left as it is.

Tensor parallelism (megatron-core 0.16.1's ColumnParallelLinear / RowParallelLinear, read in
tensor_parallel/layers.py and mappings.py):

- column-parallel (linear_qkv, linear_fc1): A replicated, B split along the output like W.
  Without sequence parallelism ``h = A x`` goes through copy_to_tensor_model_parallel_region
  (backward all-reduce), so A's gradient and the input gradient of the adapter path are the
  full sums on every TP rank; with it, ``h`` (r wide, not the hidden width) is all-gathered
  along the sequence as the base gathers x, and A's gradient, a per-sequence-shard partial
  sum, is all-reduced with the layer norms' (the ``sequence_parallel`` mark that
  finalize_model_grads reads).
- row-parallel (linear_proj, linear_fc2): A split along the input like W, B replicated: the
  partial ``h = A x`` is all-reduced (reduce-scattered along the sequence with SP) before B,
  r values per token instead of the hidden width. With SP, B's gradient is marked like A's above.
- routed experts (SequentialMLP's local experts, expert_tensor_parallel_size 1): no
  communication of their own, as the base expert linears (the token dispatcher moves tokens).

linear_fc1 is a gated MLP's fused [gate; up]: its B is [2, out/2, r] (gate and up rows), so
the tensor sharded over TP is the same global [2, ffn, r] at any TP size, where a flat [2 ffn, r]
would interleave gate and up shards by TP rank (megatron's stride-2 layout of W).

A is initialised from a generator seeded by the run's seed and the site's global name, as a
full [r, in] tensor and then cut to this rank's shard: every layout starts from the same adapters.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_dapo.config.model import LORA_TARGETS

__all__ = ["LoraModel", "LoraSite", "apply_lora", "is_lora_param", "lora_of"]

_ATTR = "_megatron_dapo_lora"
_PARAM_SUFFIXES = (".lora_A", ".lora_B")
_SUBMODULES = {  # site path inside a layer -> target name
    r"self_attention\.linear_qkv": "linear_qkv",
    r"self_attention\.linear_proj": "linear_proj",
    r"mlp\.linear_fc1": "linear_fc1",
    r"mlp\.linear_fc2": "linear_fc2",
    r"mlp\.experts\.local_experts\.\d+\.linear_fc1": "experts",
    r"mlp\.experts\.local_experts\.\d+\.linear_fc2": "experts",
}
_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_LOCAL_EXPERT_RE = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])")


def is_lora_param(name: str) -> bool:
    """Whether a GPTModel parameter name is an adapter's (not a base weight)."""
    return name.endswith(_PARAM_SUFFIXES)


@dataclass(kw_only=True, eq=False)
class LoraSite:
    """One adapted linear of this rank's stage."""

    path: str
    """Module path in the GPTModel (decoder.layers.<local>.self_attention.linear_qkv)."""
    global_path: str
    """The same with the global layer number and expert index: names it in checkpoints and exports."""
    module: Any
    kind: str
    """column | row"""
    comm: str
    """none | tp | sp: what the adapter path communicates (module docstring)."""
    gated: bool
    """linear_fc1 of a gated MLP: B is [2, out/2, r]."""
    tp: int
    tp_rank: int
    expert: bool

    @property
    def weight_name(self) -> str:
        return f"{self.path}.weight"

    def b_matrix(self) -> torch.Tensor:
        b = self.module.lora_B
        return b.reshape(-1, b.shape[-1])

    def delta(self, x: torch.Tensor, scale: float, dropout: float, training: bool) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        group = self.module.tp_group
        if dropout and training:
            x = F.dropout(x, dropout)
        h = F.linear(x, self.module.lora_A)
        if self.kind == "column":
            if self.comm == "sp":
                h = gather_from_sequence_parallel_region(h, True, group)
            elif self.comm == "tp":
                h = copy_to_tensor_model_parallel_region(h, group)
        elif self.comm == "sp":
            h = reduce_scatter_to_sequence_parallel_region(h, group)
        elif self.comm == "tp":
            h = reduce_from_tensor_model_parallel_region(h, group)
        return F.linear(h, self.b_matrix()) * scale

    def merged(self, weight: torch.Tensor, scale: float) -> torch.Tensor:
        """This rank's shard of ``W + scale B A``, computed in float32, in W's dtype."""
        with torch.no_grad():
            low = self.b_matrix().float() @ self.module.lora_A.float()
            return (weight.float() + scale * low).to(weight.dtype)


class LoraModel:
    """The adapters of one GPTModel stage: their sites, scale, and whether they are on."""

    def __init__(self, sites: list[LoraSite], *, rank: int, alpha: float, dropout: float, targets: tuple[str, ...]):
        self.sites = sites
        self.rank, self.alpha, self.dropout, self.targets = rank, alpha, dropout, targets
        self.scale = alpha / rank
        self.enabled = True
        self.base: dict[str, Any] | None = None
        """The base's identity (state.base_identity), written to checkpoints' manifests."""
        self._by_weight = {s.weight_name: s for s in sites}

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: adapters off (the reference policy of the KL loss, no second copy)."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    def params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(local parameter name, parameter) of every adapter tensor, in site order."""
        for s in self.sites:
            yield f"{s.path}.lora_A", s.module.lora_A
            yield f"{s.path}.lora_B", s.module.lora_B

    def site_of_weight(self, name: str) -> LoraSite | None:
        return self._by_weight.get(name)

    def num_params(self) -> int:
        return sum(p.numel() for _, p in self.params())


def lora_of(model: Any) -> LoraModel | None:
    """The LoraModel of a GPTModel (or a wrapper of one), None without adapters."""
    if isinstance(model, list | tuple):  # one model chunk
        model = model[0] if len(model) == 1 else None
    while model is not None and not hasattr(model, _ATTR) and hasattr(model, "module"):
        model = model.module  # DDP / Float16Module wrappers
    return getattr(model, _ATTR, None)


def apply_lora(gpt: Any, *, rank: int, alpha: float, dropout: float, targets: tuple[str, ...], seed: int,
               expert_offset: int = 0) -> LoraModel:
    """Add adapters to this stage's linears in ``targets`` and freeze every other parameter.

    Call it after the base weights are loaded and before DDP and the optimizer are built (they
    then see only the adapters). Idempotent guard: a model gets adapters once.

    Args:
        gpt: this stage's GPTModel (local layer spec).
        rank, alpha, dropout: model.lora's.
        targets: names of LORA_TARGETS.
        seed: trainer.seed; A's initialisation depends on it and the site's global name only.
        expert_offset: global index of this EP rank's first local expert.

    Raises:
        ValueError: a model that already has adapters, or a site on a layer the adapters cannot
            shard (Transformer Engine's, a sharded expert).
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        set_tensor_model_parallel_attributes,
    )

    if getattr(gpt, _ATTR, None) is not None:
        raise ValueError("the model already has LoRA adapters")
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"LoRA targets {unknown}; choose among {LORA_TARGETS}")
    gpt.requires_grad_(False)
    layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(gpt.decoder.layers)}
    sites: list[LoraSite] = []
    for path, module in gpt.named_modules():
        match = _LAYER_RE.fullmatch(path)
        if match is None:
            continue
        sub = match.group(2)
        target = next((t for pattern, t in _SUBMODULES.items() if re.fullmatch(pattern, sub)), None)
        if target is None or target not in targets:
            continue
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            raise ValueError(f"LoRA on {path}: {type(module).__name__} is not megatron's local ColumnParallelLinear or "
                             "RowParallelLinear; build the model with the local layer spec (model.transformer_impl=local)")
        kind = "column" if isinstance(module, ColumnParallelLinear) else "row"
        tp, tp_rank = module.tp_group.size(), module.tp_group.rank()
        expert = target == "experts"
        if expert and tp > 1:
            raise ValueError(f"LoRA on {path}: experts sharded over expert_tensor_parallel_size={tp} are not supported; "
                             "set parallel.expert_tensor_parallel_size=1 or leave experts out of model.lora.target_modules")
        comm = "none" if tp == 1 or module.explicit_expert_comm else ("sp" if module.sequence_parallel else "tp")
        layer = layer_numbers[int(match.group(1))]
        if (e := _LOCAL_EXPERT_RE.fullmatch(sub)) is not None:
            sub = f"mlp.experts.{expert_offset + int(e.group(1))}.{e.group(2)}"
        global_path = f"decoder.layers.{layer}.{sub}"
        weight = module.weight
        out_local, in_local = weight.shape
        gated = path.endswith("linear_fc1") and bool(module.config.gated_linear_unit)
        in_full = in_local * tp if kind == "row" else in_local
        a_full = torch.empty(rank, in_full, dtype=torch.float32)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(global_path.encode())) % 2**63)
        bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)), as torch.nn.Linear and PEFT
        a_full.uniform_(-bound, bound, generator=gen)
        a = a_full if kind == "column" else a_full.chunk(tp, dim=1)[tp_rank]
        b_shape = (2, out_local // 2, rank) if gated else (out_local, rank)
        module.lora_A = torch.nn.Parameter(a.contiguous().to(weight.dtype).to(weight.device))
        module.lora_B = torch.nn.Parameter(torch.zeros(b_shape, dtype=weight.dtype, device=weight.device))
        if expert:
            # As megatron marks the base experts' weights (tensor_parallel/layers.py): the grad norm
            # counts them on every rank, each rank holding its own experts (or their own shards).
            set_tensor_model_parallel_attributes(module.lora_A, True, 1, 1)
            set_tensor_model_parallel_attributes(module.lora_B, True, 1 if gated else 0, 1)
        elif tp > 1:
            if kind == "column":
                set_tensor_model_parallel_attributes(module.lora_B, True, 1 if gated else 0, 1)
            else:
                set_tensor_model_parallel_attributes(module.lora_A, True, 1, 1)
        if comm == "sp":  # replicated, its gradient a per-sequence-shard partial sum
            (module.lora_A if kind == "column" else module.lora_B).sequence_parallel = True
        if hasattr(weight, "allreduce"):  # expert-parallel parameters reduce over the expert-DP group
            module.lora_A.allreduce = module.lora_B.allreduce = weight.allreduce
        site = LoraSite(path=path, global_path=global_path, module=module, kind=kind, comm=comm, gated=gated,
                        tp=tp, tp_rank=tp_rank, expert=expert)
        sites.append(site)
    lora = LoraModel(sites, rank=rank, alpha=alpha, dropout=dropout, targets=targets)
    for site in sites:
        site.module.register_forward_hook(_hook(site, lora))
    if getattr(gpt, "pre_process", False):
        # The frozen embedding's output needs no gradient, so under activation recompute
        # megatron's CheckpointFunction (tensor_parallel/random.py) would return outputs that
        # need none either, and no adapter would train: the first stage's layer input asks for
        # one (PEFT's enable_input_require_grads). Later stages receive theirs from the schedule.
        gpt.embedding.register_forward_hook(_input_requires_grad)
    setattr(gpt, _ATTR, lora)
    return lora


def _input_requires_grad(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


def _hook(site: LoraSite, lora: LoraModel) -> Any:
    def hook(module: Any, args: tuple[Any, ...], output: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
        if not lora.enabled:
            return output
        out, bias = output
        return out + site.delta(args[0], lora.scale, lora.dropout, module.training).to(out.dtype), bias

    return hook
