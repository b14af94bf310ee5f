"""A LoRA training checkpoint out as HF weights: merged (the default) or PEFT's adapter directory.

The checkpoint holds adapters only (lora/state.py); the base they adapt is the directory its
manifest names (or ``--base``), refused in one line when its fingerprint differs. Both forms
load the base at TP 1 in this process, apply the adapters with the run's rank, alpha and
targets, and load the saved adapters (any saved layout):

- merged: every adapted weight as ``W + (alpha/r) B A`` in float32, cast to the checkpoint's
  dtype, through the same export and shard writer as a full checkpoint's (convert.py);
- PEFT (``--peft``): ``adapter_config.json`` and ``adapter_model.safetensors`` in PEFT's names
  (``base_model.model.<module>.lora_A.weight`` [r, in], ``lora_B.weight`` [out, r]). Megatron's
  fused linears become HF's separate ones: q/k/v share linear_qkv's A and take their rows of
  its B (de-interleaved by query group, as the weights are); gate/up share linear_fc1's A and
  take B's two halves. ``target_modules`` lists the exact modules adapted, so PEFT adds no
  adapter where the run had none (experts left out, pipeline-split models).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.checkpoint.files import CheckpointError
from megatron_dapo.lora.layers import LoraModel, apply_lora
from megatron_dapo.lora.state import base_identity

__all__ = ["PEFT_CONFIG", "PEFT_WEIGHTS", "export_lora_checkpoint", "load_lora_checkpoint", "peft_from_factors", "peft_tensors", "write_peft"]

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"

_HF_MODULES = {  # megatron site suffix -> HF modules it becomes
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


def resolve_base(manifest: dict[str, Any], where: str, base: str | None) -> Path:
    """The base directory of a LoRA checkpoint: ``base`` or the manifest's, with a matching fingerprint."""
    saved = manifest["lora"].get("base") or {}
    path = Path(base) if base else Path(saved.get("path", ""))
    if not (path / "config.json").is_file():
        raise CheckpointError(f"checkpoint {where} holds LoRA adapters of the base {saved.get('path')}, which is not an "
                              "HF directory here: pass --base DIR with that base model")
    if base_identity(path)["fingerprint"] != saved.get("fingerprint"):
        raise CheckpointError(f"checkpoint {where} holds LoRA adapters of the base {saved.get('path')}, and {path} has "
                              "other weights: pass --base DIR with the base the run trained on")
    return path


def load_lora_checkpoint(path: Path, manifest: dict[str, Any], base: Path, dims: Any, dtype: torch.dtype
                         ) -> tuple[Any, Any, LoraModel]:
    """(adapter, model, adapters) at this layout: the base loaded, the saved adapters applied."""
    from megatron_dapo.checkpoint.manager import CheckpointManager
    from megatron_dapo.models import adapter_for

    adapter = adapter_for(base)
    model = adapter.build_model(dims, dtype=dtype, init_weights=False)
    adapter.load_hf(model, base, dims)
    saved = manifest["lora"]
    hf = adapter.hf
    lora = apply_lora(model, rank=int(saved["rank"]), alpha=float(saved["alpha"]), dropout=0.0,
                      targets=tuple(saved["targets"]), seed=0,
                      expert_offset=dims.ep_rank * (hf.num_experts // dims.ep) if hf.is_moe else 0)
    lora.base = base_identity(base)
    CheckpointManager(path.parent).load(path, [model], model_family=hf.family, load_rng=False)
    return adapter, model, lora


def export_lora_checkpoint(path: Path, manifest: dict[str, Any], out_dir: Path, dtype: torch.dtype, *, peft: bool,
                           base: str | None) -> tuple[Any, Any, Any]:
    """A LoRA checkpoint loaded onto its base at TP 1 in this process; with ``peft`` its PEFT
    directory written to ``out_dir``. Returns (adapter, model, dims) for the merged export."""
    from megatron_dapo import parallel

    base_dir = resolve_base(manifest, str(path), base)
    parallel.init_distributed("cpu")
    dims = parallel.initialize_model_parallel(1, 1)
    adapter, model, lora = load_lora_checkpoint(path, manifest, base_dir, dims, dtype)
    if peft:
        write_peft(lora, adapter.hf, out_dir, base_dir, dtype)
    return adapter, model, dims


def peft_tensors(lora: LoraModel, hf: Any, factors: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
                 ) -> dict[str, torch.Tensor]:
    """PEFT's adapter tensors (module docstring), float32 copies.

    Args:
        lora: the adapters (their sites name the modules).
        hf: the model's parsed HF config.
        factors: {site global path: (whole A, whole B)} of every site (sync.gather_factors); None =
            this TP 1 model's own.
    """
    if factors is None:
        if any(site.tp != 1 for site in lora.sites):
            raise ValueError("PEFT tensors of a TP > 1 model need its gathered factors (lora/sync.py)")
        factors = {s.global_path: (s.module.lora_A.detach(), s.module.lora_B.detach()) for s in lora.sites}
    return peft_from_factors(factors, hf)


def peft_from_factors(factors: dict[str, tuple[torch.Tensor, torch.Tensor]], hf: Any) -> dict[str, torch.Tensor]:
    """PEFT's adapter tensors of whole factors by site global path (any stage's, any order)."""
    from megatron_dapo.models import mapping

    out: dict[str, torch.Tensor] = {}
    for path in sorted(factors, key=_site_order):
        prefix, sub = path.split(".", 3)[2], path.split(".", 3)[3]
        layer = f"model.layers.{prefix}"
        a, b = (t.float() for t in factors[path])
        kind, tail = next((k, v) for k, v in _HF_MODULES.items() if sub.endswith(k))
        owner = sub[: -len(kind)].rstrip(".")  # "", "mlp" or "mlp.experts.<E>"
        owner = {"": "", "mlp": "mlp."}.get(owner, owner + ".")
        if kind == "self_attention.linear_qkv":
            tm = mapping.TensorMap(mcore_name="", hf_names=("q", "k", "v"), kind="qkv", sort_key=(0,))
            parts = mapping.hf_from_shards(tm, [b], hf)
        elif kind == "linear_fc1":
            parts = [b[0], b[1]]
        else:
            parts = [b]
        for module, part in zip(tail, parts, strict=True):
            name = f"base_model.model.{layer}.{owner}{module}"
            out[f"{name}.lora_A.weight"] = a.clone()
            out[f"{name}.lora_B.weight"] = part.contiguous().clone()
    return out


def _site_order(path: str) -> tuple[int, str]:
    parts = path.split(".")
    return int(parts[2]), path


def write_peft(lora: LoraModel, hf: Any, out_dir: Path, base: Path, dtype: torch.dtype,
               tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """PEFT's adapter directory of the adapters (``tensors``: peft_tensors' already made), in ``dtype``."""
    from safetensors.torch import save_file

    tensors = {k: v.to(dtype).contiguous() for k, v in (tensors if tensors is not None else peft_tensors(lora, hf)).items()}
    modules = sorted({k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in tensors})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(Path(base).resolve()), "r": lora.rank,
        "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / PEFT_WEIGHTS), metadata={"format": "pt"})
    (out_dir / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir
