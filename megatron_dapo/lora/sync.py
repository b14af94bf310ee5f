"""The adapter-only weight sync (rollout.lora_sync=adapter): the adapters, not the merged model.

Each step the controller writes the whole model's adapters as a PEFT directory
(lora/export.py's names; vLLM reads only a directory, vllm 0.32.0 lora/worker_manager.py) under
the run's ``lora_adapters/v<version>``, and every engine loads it as a new adapter named by the
version and drops the previous one (rollout/vllm/engine.py ``load_adapter``); requests then name
it. The engines keep serving the base they started from, which is the actor's frozen base.

``gather_factors`` is collective over every rank: each TP-split factor is all-gathered over its
linear's TP group (B of a column-parallel linear along its output, A of a row-parallel one
along its input), then one rank per shard (TP rank 0 of data-parallel rank 0; for an expert,
expert-data-parallel rank 0) hands its stage's whole factors to global rank 0 in one
gather_object: adapters are small (a 32B model's rank-64 adapters are 0.9 GB in bf16).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.lora.export import peft_from_factors, write_peft
from megatron_dapo.lora.layers import LoraModel, LoraSite
from megatron_dapo.rollout.weight_sync import WeightSyncStats

__all__ = ["ADAPTERS_DIR", "AdapterSync", "gather_factors"]

ADAPTERS_DIR = "lora_adapters"


def _whole(site: LoraSite) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = site.module.lora_A.detach(), site.module.lora_B.detach()
    if site.tp == 1:
        return a.cpu(), b.cpu()
    group = site.module.tp_group
    if site.kind == "column":
        axis = 1 if site.gated else 0
        parts = [torch.empty_like(b) for _ in range(site.tp)]
        dist.all_gather(parts, b.contiguous(), group=group)
        return a.cpu(), torch.cat(parts, dim=axis).cpu()
    parts = [torch.empty_like(a) for _ in range(site.tp)]
    dist.all_gather(parts, a.contiguous(), group=group)
    return torch.cat(parts, dim=1).cpu(), b.cpu()


def gather_factors(lora: LoraModel) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """{site global path: (whole A, whole B)} of the whole model on global rank 0, None elsewhere (collective)."""
    whole = {s.global_path: _whole(s) for s in lora.sites}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return whole
    from megatron.core import parallel_state

    dense_owner = parallel_state.get_tensor_model_parallel_rank() == 0 and \
        parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    expert_owner = parallel_state.get_expert_data_parallel_rank() == 0 if any(s.expert for s in lora.sites) else False
    mine = {s.global_path: whole[s.global_path] for s in lora.sites if (expert_owner if s.expert else dense_owner)}
    received: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, received, dst=0)
    if received is None:
        return None
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for part in received:
        out.update(part)
    return out


class AdapterSync:
    """Writes each version's adapter directory on the controller and keeps the one engines serve.

    Args:
        root: the run's output directory (the adapters go under ``lora_adapters/``).
        base: the base the engines serve (named in adapter_config.json).
        hf: the model's parsed HF config.
        dtype: the engines' dtype for the adapter tensors.
    """

    def __init__(self, root: Path, base: Path, hf: Any, dtype: torch.dtype) -> None:
        self.root = root / ADAPTERS_DIR
        self.base, self.hf, self.dtype = base, hf, dtype
        self.current: Path | None = None
        # A run killed earlier left its directories; the engines start from the base, nothing serves them.
        shutil.rmtree(self.root, ignore_errors=True)

    def write(self, lora: LoraModel, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], version: int) -> Path:
        """This version's PEFT directory (written to a temporary name, then renamed: complete or absent)."""
        final = self.root / f"v{version}"
        tmp = self.root / f".tmp-v{version}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_peft(lora, self.hf, tmp, self.base, self.dtype, tensors=peft_from_factors(factors, self.hf))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final

    def served(self, directory: Path) -> None:
        """The engines serve ``directory`` now: the previous version's is removed."""
        previous, self.current = self.current, directory
        if previous is not None and previous != directory:
            shutil.rmtree(previous, ignore_errors=True)

    def sync(self, lora: LoraModel, rollout: Any | None, version: int) -> WeightSyncStats:
        """One adapter-only sync (collective): gathered to the controller, written, loaded by
        every engine of ``rollout`` (the controller's RolloutController; None on other ranks)."""
        start = time.perf_counter()
        factors = gather_factors(lora)
        num_bytes = 0
        if factors is not None and rollout is not None:
            directory = self.write(lora, factors, version)
            rollout.load_adapter(str(directory), version)
            self.served(directory)
            num_bytes = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        return WeightSyncStats(num_bytes=num_bytes, num_tensors=2 * len(factors or {}), num_buckets=1,
                               seconds=time.perf_counter() - start, peak_bucket_bytes=num_bytes)
