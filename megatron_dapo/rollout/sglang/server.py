"""Launching SGLang servers: command line, address, API key, log file, death detection.

One server per rollout tensor-parallel group (SGLang 0.5.x, ``python -m sglang.launch_server``).
The flags that matter for RL and why:
- ``--skip-tokenizer-init``: token ids in and out; the trainer owns tokenization and a
  response is never re-tokenized;
- ``--enable-memory-saver``: lets /release_memory_occupation give weights and KV cache back
  to Megatron while it trains on the same GPUs (colocation);
- ``--mem-fraction-static``: the share of GPU memory SGLang takes when resumed;
- ``--host``: this node's address, never 0.0.0.0 unless the user asks, plus ``--api-key``
  (random per engine) so other users of the cluster network cannot drive the server;
- ``--base-gpu-id`` / ``--tp-size``: engines take consecutive GPUs of the node.
The process writes stdout and stderr to one log file per engine; when it dies, the error
names the engine, its exit code and the log's last lines.
"""

from __future__ import annotations

import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_dapo.rollout.server_process import free_port, node_address

__all__ = ["SGLangServerConfig", "build_launch_command", "resolve_server_config"]

@dataclass(kw_only=True, slots=True)
class SGLangServerConfig:
    """How to launch one SGLang server (one rollout engine)."""

    model_path: str
    """HF checkpoint directory the server loads at start (weights are then synced)."""
    tp_size: int = 1
    """GPUs of this engine (--tp-size)."""
    base_gpu_id: int = 0
    """First GPU of this engine on the node (--base-gpu-id); engines take consecutive GPUs."""
    mem_fraction_static: float = 0.7
    """Share of GPU memory for weights + KV cache (--mem-fraction-static)."""
    host: str = ""
    """Address to bind; empty = this node's address (never 0.0.0.0 unless given explicitly)."""
    port: int = 0
    """HTTP port; 0 = a free port chosen at launch."""
    nccl_port: int = 0
    """Port of the server's internal TP group; 0 = a free port chosen at launch."""
    api_key: str = ""
    """Bearer token the server requires; empty = a random one per engine."""
    dtype: str = "bfloat16"
    """Weight dtype of the server (--dtype)."""
    random_seed: int = 0
    """Server seed (--random-seed)."""
    log_path: str = ""
    """File for the server's stdout/stderr; empty = <cwd>/sglang_<engine>.log."""
    deterministic: bool = False
    """--enable-deterministic-inference: batch-invariant kernels and per-request seeds
    (reproducible rollouts, slower)."""
    extra_args: tuple[str, ...] = ()
    """Further launch_server flags, passed through verbatim."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the server process."""

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"SGLangServerConfig.tp_size={self.tp_size} must be >= 1")
        if self.base_gpu_id < 0:
            raise ValueError(f"SGLangServerConfig.base_gpu_id={self.base_gpu_id} must be >= 0")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"SGLangServerConfig.mem_fraction_static={self.mem_fraction_static} must be in (0, 1) "
                "(rollout.gpu_memory_utilization)"
            )


def build_launch_command(config: SGLangServerConfig, *, python: str = sys.executable) -> list[str]:
    """The ``python -m sglang.launch_server`` command line of one engine.

    Args:
        config: a config with host, port, nccl_port and api_key already resolved.
        python: interpreter to run SGLang with.

    Returns:
        argv list (no shell).
    """
    assert config.host and config.port and config.nccl_port and config.api_key, "resolve the config first"
    return [
        python, "-m", "sglang.launch_server",
        "--model-path", config.model_path,
        "--host", config.host,
        "--port", str(config.port),
        "--nccl-port", str(config.nccl_port),
        "--tp-size", str(config.tp_size),
        "--base-gpu-id", str(config.base_gpu_id),
        "--mem-fraction-static", str(config.mem_fraction_static),
        "--dtype", config.dtype,
        "--random-seed", str(config.random_seed),
        "--api-key", config.api_key,
        # Token ids in and out: the trainer owns tokenization, responses are never re-tokenized.
        "--skip-tokenizer-init",
        # Lets /release_memory_occupation hand weights + KV cache back to Megatron.
        "--enable-memory-saver",
        *(["--enable-deterministic-inference"] if config.deterministic else []),
        *config.extra_args,
    ]  # fmt: skip


def resolve_server_config(config: SGLangServerConfig, name: str) -> SGLangServerConfig:
    """Fill in what was left unset: host, free ports, a random API key, the log path.

    Args:
        config: the user's settings.
        name: engine name (names the default log file).

    Returns:
        A new config with every launch field set.
    """
    host = config.host or node_address()
    return SGLangServerConfig(
        model_path=config.model_path,
        tp_size=config.tp_size,
        base_gpu_id=config.base_gpu_id,
        mem_fraction_static=config.mem_fraction_static,
        host=host,
        port=config.port or free_port(host),
        nccl_port=config.nccl_port or free_port(host),
        api_key=config.api_key or secrets.token_urlsafe(24),
        dtype=config.dtype,
        random_seed=config.random_seed,
        log_path=config.log_path or str(Path.cwd() / f"sglang_{name}.log"),
        deterministic=config.deterministic,
        extra_args=config.extra_args,
        env=dict(config.env),
    )
