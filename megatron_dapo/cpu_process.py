"""Processes whose work is CPU-only hide the GPUs from themselves, before anything touches CUDA.

The one-process converters stream a checkpoint through host memory on megatron-core's CPU layer
(device.py), which cannot run beside a live CUDA runtime; on the GPU nodes where users train,
`tools/convert_mcore_to_hf.py` and `megatron-dapo eval <training checkpoint>` died with "the CPU
layer cannot run next to a live CUDA runtime" unless the user set CUDA_VISIBLE_DEVICES=''
(issue 39). The driver reads CUDA_VISIBLE_DEVICES once, at its first CUDA call (torch's
`is_available()` included, which megatron-core's imports make), so this module imports nothing
heavy and its function runs at the entry point, before megatron-core is imported.
"""

from __future__ import annotations

import os
import sys

__all__ = ["hide_gpus_for_cpu_work", "one_process"]


def one_process(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether no launcher started this process as one of several ranks (parallel.launcher_ranks' rule)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return env["WORLD_SIZE"] == "1"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return env["SLURM_NTASKS"] == "1"
    return True


def hide_gpus_for_cpu_work() -> bool:
    """Make this process see no GPU (CUDA_VISIBLE_DEVICES=''), if it is one process and CUDA is untouched.

    Returns:
        True if the GPUs are hidden now (or were already); False under a multi-rank launcher, whose
        ranks use their GPUs.

    Raises:
        RuntimeError: CUDA was initialised before the call (a bug: call it at the entry point).
    """
    if not one_process():
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("hide_gpus_for_cpu_work() called after CUDA was initialised; call it at the entry point")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return True
