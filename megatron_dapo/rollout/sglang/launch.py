"""Launching the SGLang servers of a job: one process for a node's GPUs, or each leader rank its own.

Colocated training launches through :func:`launch_colocated_engines`, collectively: each
engine's leader rank starts its server (colocated.py holds what the ranks do with them
afterwards). :func:`launch_node_engines` starts all of one node's engines from one process.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_dapo.rollout.engine import RolloutEngine
from megatron_dapo.rollout.flat_bucket import FLATTENED_BUCKET
from megatron_dapo.rollout.placement import EngineSlot, plan_placement, ranks_per_node_from_env
from megatron_dapo.rollout.routes import RouteShape
from megatron_dapo.rollout.server_process import node_address
from megatron_dapo.rollout.sglang.colocated import ColocatedEngines, EngineInfo, LeaderEngine, Serializer
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import (
    CPU_KV_TOKENS,
    SGLangServerConfig,
    copies_lm_head,
)
from megatron_dapo.rollout.sglang.weights import serializer_for

if TYPE_CHECKING:
    from megatron_dapo.config import RolloutConfig

__all__ = ["launch_colocated_engines", "launch_node_engines"]


def launch_colocated_engines(
    config: RolloutConfig,
    model_path: str | Path,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    log_dir: str | Path | None = None,
    startup_timeout_s: float = 900.0,
    serializer: Serializer | None = None,
    device: str = "cuda",
    dtype: str = "bfloat16",
    max_restarts: int | None = None,
    return_routes: bool = False,
    lora_rank: int = 0,
    lora_modules: tuple[str, ...] = (),
) -> ColocatedEngines:
    """Collective: start SGLang engines on the GPUs of every node and connect the controller to all.

    Args:
        config: the rollout section (TP size, memory fraction, host, request timeout).
        model_path: HF checkpoint every server loads at start (reachable on every node).
        rank: global rank.
        world_size: ranks of the job.
        local_rank: rank on this node (= its GPU).
        log_dir: directory of the engine logs (sglang<e>.log); None = the cwd of each leader.
        startup_timeout_s: how long a server may take to load.
        serializer: override of the device's serializer (weights.serializer_for).
        device: the actor's device type: "cuda", or "cpu" (SGLang's CPU engine, one server per
            rank group as on GPUs; server.py has the flags that differ).
        dtype: the servers' weight dtype, the actor's ("float32", "bfloat16").
        max_restarts: None = rollout.max_engine_restarts. A one-process job on a CPU has
            none here: its controller feeds its server and restarts it (run.py).
        return_routes: the servers report every row's routed experts (routing replay).
        lora_rank: > 0: the servers serve LoRA adapters up to this rank on ``lora_modules``
            (rollout.lora_sync=adapter; adapters.py).

    Returns:
        This rank's ColocatedEngines; on the controller ``clients`` holds every engine.
    """
    placement = plan_placement(world_size=world_size, gpus_per_node=ranks_per_node_from_env(world_size),
                               engine_tp=config.tensor_model_parallel_size)
    host = config.host or node_address()
    controller_fed = world_size == 1 and device == "cpu"
    if max_restarts is None:
        max_restarts = 0 if controller_fed else config.max_engine_restarts

    def start(slot: EngineSlot) -> tuple[LeaderEngine, EngineInfo]:
        kv_tokens = config.sglang.max_total_tokens or (CPU_KV_TOKENS if device == "cpu" else 0)
        # Ports are left to the engine: one another process took before the server bound it is
        # picked anew (SGLangEngine.wait_until_healthy); the announced URL is the one it serves on.
        engine = SGLangEngine.launch(SGLangServerConfig(
            model_path=str(model_path), tp_size=slot.tp_size, base_gpu_id=slot.base_gpu_id,
            mem_fraction_static=config.gpu_memory_utilization, host=host, dtype=dtype, device=device,
            max_total_tokens=kv_tokens, python=config.sglang.python or "", return_routes=return_routes,
            lora_rank=lora_rank, lora_modules=lora_modules,
            log_path=str(Path(log_dir) / f"{slot.name}.log") if log_dir is not None else "",
        ), name=slot.name, startup_timeout_s=startup_timeout_s, request_timeout_s=config.request_timeout_s)  # fmt: skip
        server = engine.server_config
        # The ranks' sync feeds it, except in a one-process job on a CPU, whose weights go
        # through the controller (run.Run.sync_weights), which then restarts it itself.
        engine.fed_by_ranks = not controller_fed
        # A server bound to every interface is reached through the node's own address.
        address = node_address() if server.host in ("0.0.0.0", "::") else server.host
        info = EngineInfo(name=slot.name, url=f"http://{address}:{server.port}", api_key=server.api_key,
                          tp_size=slot.tp_size, leader_rank=slot.leader_rank, node=slot.node,
                          host=socket.gethostname(), log_path=server.log_path, deterministic=server.deterministic)
        return engine, info

    routes = RouteShape.of_checkpoint(model_path) if return_routes else None

    def client(info: EngineInfo) -> RolloutEngine:
        return SGLangEngine(info.url, name=info.name, api_key=info.api_key, tp_size=info.tp_size, routes=routes,
                            request_timeout_s=config.request_timeout_s, deterministic=info.deterministic,
                            log_location=f"{info.host}:{info.log_path} (owned by rank {info.leader_rank})")

    # CPU payloads are written by our own serializer, which always speaks the flattened format
    # (sglang >= 0.5.1 reads it); CUDA follows the sglang installed beside the trainer.
    return ColocatedEngines.create(placement, rank=rank, local_rank=local_rank, start_engine=start,
                                   make_client=client, serializer=serializer or serializer_for(device),
                                   weight_format=FLATTENED_BUCKET if device == "cpu" else None,
                                   max_restarts=max_restarts, restart_timeout_s=startup_timeout_s + 900.0,
                                   lm_head_copy=copies_lm_head(model_path))


def launch_node_engines(
    config: RolloutConfig,
    model_path: str | Path,
    *,
    num_gpus: int | None = None,
    log_dir: str | Path | None = None,
    startup_timeout_s: float = 900.0,
) -> list[SGLangEngine]:
    """Launch one engine per ``tensor_model_parallel_size`` GPUs of this node, all loading at once.

    One process drives them all: single-node use. Multi-node colocated training launches
    through colocated.launch_colocated_engines, where each engine's leader rank starts it.

    Args:
        config: the rollout section (TP size, memory fraction, host, request timeout).
        model_path: HF checkpoint every server loads at start.
        num_gpus: GPUs of the node to use; None = all visible (torch.cuda.device_count()).
        log_dir: directory of the per-engine logs (sglang0.log, ...); None = the cwd.
        startup_timeout_s: how long the servers may take to load.

    Returns:
        Healthy engines ``sglang0, sglang1, ...`` on GPUs ``[0, tp), [tp, 2 tp), ...``.
    """
    tp = config.tensor_model_parallel_size
    num_gpus = torch.cuda.device_count() if num_gpus is None else num_gpus
    if num_gpus < tp or num_gpus % tp:
        raise ValueError(
            f"rollout.tensor_model_parallel_size={tp} does not divide this node's {num_gpus} GPUs; "
            "pick a divisor of the GPU count (rollout.engine: local runs without GPUs)"
        )
    engines: list[SGLangEngine] = []
    try:
        for index in range(num_gpus // tp):
            name = f"sglang{index}"
            server = SGLangServerConfig(
                model_path=str(model_path),
                tp_size=tp,
                base_gpu_id=index * tp,
                mem_fraction_static=config.gpu_memory_utilization,
                host=config.host or "",
                log_path=str(Path(log_dir) / f"{name}.log") if log_dir is not None else "",
            )
            engines.append(SGLangEngine.start(server, name=name, request_timeout_s=config.request_timeout_s))
        for engine in engines:
            engine.wait_until_healthy(timeout_s=startup_timeout_s)
    except BaseException:
        for engine in engines:
            engine.shutdown()
        raise
    return engines
