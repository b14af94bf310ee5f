"""Launching SGLang servers: command line, address, API key, log file, death detection.

One server per rollout tensor-parallel group (SGLang 0.5.x, ``python -m sglang.launch_server``).
The flags that matter for RL and why:
- ``--skip-tokenizer-init``: token ids in and out; the trainer owns tokenization and a
  response is never re-tokenized;
- ``--enable-memory-saver``: lets /release_memory_occupation give weights and KV cache back
  to Megatron while it trains on the same GPUs (colocation);
- ``--mem-fraction-static``: the share of GPU memory SGLang takes when resumed;
- ``--host``: this node's address, never 0.0.0.0 unless the user asks, plus an API key (random
  per engine, in a 0600 file read with ``--config``) so other users of the node or the cluster
  network cannot drive the server;
- ``--base-gpu-id`` / ``--tp-size``: engines take consecutive GPUs of the node.
The process writes stdout and stderr to one log file per engine; when it dies, the error
names the engine, its exit code and the log's last lines.

On a CPU (``device="cpu"``, read on sglang 0.5.18 with its CPU kernel package) the same
server runs with ``--device cpu`` and SGLANG_USE_CPU_ENGINE=1, and differs in four flags
(DESIGN.md, "SGLang on CPU"): no ``--enable-memory-saver`` (torch_memory_saver loads
libcuda and the server does not start), ``--attention-backend torch_native`` (the CPU
kernels' attention needs AMX), ``--disable-overlap-schedule``, and
``--skip-server-warmup`` (the warm-up request is text through the model's tokenizer, which
a ``--skip-tokenizer-init`` server does not have; a failed warm-up takes the server down).
The KV pool is sized in tokens (``--max-total-tokens``), not as a share of host memory.

Which Python runs the server, and the check that it can: rollout/sglang/interpreter.py.
"""

from __future__ import annotations

import collections
import json
import os
import re
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_dapo.launcher import free_ports
from megatron_dapo.rollout.fleet.cores import server_cores
from megatron_dapo.rollout.server_process import node_address
from megatron_dapo.rollout.sglang.adapters import lora_launch_args
from megatron_dapo.rollout.sglang.interpreter import INSTALL_HINT, default_cpu_venv, sglang_python

__all__ = [
    "SGLangServerConfig",
    "build_launch_command",
    "copies_lm_head",
    "cpu_fleet_binding",
    "default_cpu_venv",
    "resolve_server_config",
    "secret_config_path",
    "server_env",
    "sglang_python",
    "write_secret_config",
]

CPU_KV_TOKENS = 65536
"""A CPU server's KV pool when rollout.sglang.max_total_tokens is null (64k tokens of the tiny
model are a few hundred MB; a share of host memory, SGLang's own sizing, would be gigabytes)."""

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
    device: str = "cuda"
    """cuda, or cpu: SGLang's CPU engine (module docstring: the flags that differ)."""
    max_total_tokens: int = 0
    """KV-cache pool in tokens (--max-total-tokens); 0 = SGLang's own sizing from mem_fraction_static
    (GPUs). A CPU server needs it: its pool would otherwise be a share of host memory."""
    python: str = ""
    """Interpreter that runs the server; empty = :func:`sglang_python`."""
    return_routes: bool = False
    """--enable-return-routed-experts: the server keeps every token's routed experts (a host buffer of
    KV tokens x layers x k int32) so requests can ask for them (routing replay, rollout/routes.py)."""
    extra_args: tuple[str, ...] = ()
    """Further launch_server flags, passed through verbatim."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the server process."""
    launcher: tuple[str, ...] = ()
    """argv put before the server's command: an srun step on a node of the fleet's own
    (rollout/fleet/nodes.py; host is then that node's address, the ports free on this one)."""
    releases_memory: bool = True
    """A GPU server that hands its weights and KV cache to training between rollouts (colocated:
    --enable-memory-saver, which needs torch_memory_saver); a fleet's server on GPUs of its own keeps them."""
    lora_rank: int = 0
    """> 0: the server serves LoRA adapters up to this rank, loaded at run time (rollout.lora_sync=adapter;
    adapters.py has the flags)."""
    lora_modules: tuple[str, ...] = ()
    """The HF modules those adapters are on (--lora-target-modules; adapters.lora_modules)."""

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"SGLangServerConfig.tp_size={self.tp_size} must be >= 1")
        if self.base_gpu_id < 0:
            raise ValueError(f"SGLangServerConfig.base_gpu_id={self.base_gpu_id} must be >= 0")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"SGLangServerConfig.device={self.device!r} must be cuda or cpu")
        if self.lora_rank < 0 or (self.lora_rank > 0 and not self.lora_modules):
            raise ValueError(f"SGLangServerConfig.lora_rank={self.lora_rank} must be >= 0 (0 = no LoRA), and a rank "
                             "> 0 needs lora_modules (the HF modules its adapters are on)")
        if self.device == "cpu" and self.max_total_tokens <= 0:
            raise ValueError("SGLangServerConfig.max_total_tokens must be > 0 on a CPU (rollout.sglang.max_total_tokens)")
        if self.api_key and not re.fullmatch(r"[A-Za-z0-9_.~+/=][A-Za-z0-9_.~+/=-]*", self.api_key):
            raise ValueError("SGLangServerConfig.api_key must be letters, digits and _.~+/=- and not start with '-' "
                             "(it reaches SGLang's argument parser as a separate token)")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"SGLangServerConfig.mem_fraction_static={self.mem_fraction_static} must be in (0, 1) "
                "(rollout.gpu_memory_utilization)"
            )


def build_launch_command(config: SGLangServerConfig, secret_path: Path | None = None) -> list[str]:
    """The ``python -m sglang.launch_server`` command line of one engine.

    Args:
        config: a config resolved by :func:`resolve_server_config` (host, ports, key, python).
        secret_path: the key's file of this launch (write_secret_config's); None = the first
            launch's name, secret_config_path.

    Returns:
        argv list (no shell).
    """
    assert config.host and config.port and config.nccl_port and config.api_key and config.python, \
        "resolve the config first"
    if config.device == "cpu":
        if config.deterministic:
            # sglang 0.5.18 (arg_groups/overrides.py `_deterministic_attention_backend`) allows it only
            # with ascend/fa3/fa4/flashinfer/triton attention and exits at startup with torch_native.
            raise ValueError("an SGLang CPU server cannot run --enable-deterministic-inference (its torch_native "
                             "attention is not one of SGLang's deterministic backends)")
        # --sleep-on-idle: an idle scheduler waits on its sockets (a zmq poll that wakes on the next
        # request) instead of spinning a core the actor or another server needs (DESIGN.md).
        device_args = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
                       "--skip-server-warmup", "--sleep-on-idle", "--max-total-tokens", str(config.max_total_tokens)]
    else:
        # --enable-memory-saver lets /release_memory_occupation hand weights + KV cache back to Megatron.
        device_args = ["--base-gpu-id", str(config.base_gpu_id),
                       *(["--enable-memory-saver"] if config.releases_memory else []),
                       *(["--max-total-tokens", str(config.max_total_tokens)] if config.max_total_tokens else [])]
    return [
        config.python, "-m", "sglang.launch_server",
        "--model-path", config.model_path,
        "--host", config.host,
        "--port", str(config.port),
        "--nccl-port", str(config.nccl_port),
        "--tp-size", str(config.tp_size),
        "--mem-fraction-static", str(config.mem_fraction_static),
        "--dtype", config.dtype,
        "--random-seed", str(config.random_seed),
        # The key, from a file only its owner can read (secret_config_path): a command line is
        # every local user's to read in `ps`. SGLang (>= 0.5.3) merges --config's YAML into its argv.
        "--config", str(secret_path or secret_config_path(config)),
        # Token ids in and out: the trainer owns tokenization, responses are never re-tokenized.
        "--skip-tokenizer-init",
        *device_args,
        *(["--enable-deterministic-inference"] if config.deterministic else []),
        *(["--enable-return-routed-experts"] if config.return_routes else []),
        *lora_launch_args(rank=config.lora_rank, modules=config.lora_modules, device=config.device,
                          releases_memory=config.releases_memory),
        *config.extra_args,
    ]  # fmt: skip


_LAUNCHES: collections.Counter[str] = collections.Counter()
"""Launches of each log's server in this process (write_secret_config)."""
_LAUNCHES_LOCK = threading.Lock()


def secret_config_path(config: SGLangServerConfig, launch: int = 0) -> Path:
    """The YAML file of the server's key, beside its log (SGLang wants .yaml): ``<log>.secret.yaml``
    for the first launch, ``<log>.secret.<N>.yaml`` for the N-th relaunch."""
    log = Path(config.log_path)
    return log.with_name(f"{log.stem}.secret{f'.{launch}' if launch else ''}.yaml")


def write_secret_config(config: SGLangServerConfig) -> Path:
    """Write the key where only this user can read it (mode 0600), for the server's ``--config``.

    Each launch of a server gets a file of its own, never a name used before in this process nor
    one that exists (secret_config_path's N counts this process' launches of the log's server):
    the process a relaunch replaces removes its own file when it is found dead, and that happens
    while the fresh server still starts (a stream's request, a shutdown); with one name for
    both, the fresh server died with "Config file not found" (two fleet servers killed at once).

    SGLang's config merger turns each entry into ``--key value`` tokens, so a key that starts with
    "-" would read as an option: keys are hex (resolve_server_config) or checked in __post_init__.
    """
    secret_config_path(config).parent.mkdir(parents=True, exist_ok=True)
    with _LAUNCHES_LOCK:
        while True:
            launch = _LAUNCHES[str(config.log_path)]
            _LAUNCHES[str(config.log_path)] += 1
            path = secret_config_path(config, launch)
            try:  # O_EXCL: a file an earlier run left (killed) is another launch's
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileExistsError:
                continue
    try:
        os.fchmod(fd, 0o600)  # the mode whatever the umask
        os.write(fd, f"api-key: {json.dumps(config.api_key)}\n".encode())
    finally:
        os.close(fd)
    return path

CPU_BIND = "SGLANG_CPU_OMP_THREADS_BIND"
"""The cores a CPU server binds its OpenMP threads to; set by the user, their placement wins."""


def cpu_fleet_binding(index: int, num_engines: int, cores: Sequence[int] | None = None, *,
                      overlapped: bool = False) -> dict[str, str]:
    """The environment of CPU fleet server `index`: its own slice of this process's cores
    (rollout/fleet/cores.py) and one OpenMP thread per core of it.

    Read in sglang 0.5.18: a CPU server binds its OpenMP threads to SGLANG_CPU_OMP_THREADS_BIND
    (default: every core of NUMA node 0; srt/utils/numa_utils.py init_threads_binding) only where
    sgl_kernel's ``init_cpu_threads_env`` runs, that is on CPUs with AMX or on arm64
    (srt/distributed/bootstrap.py ``_init_cpu_threads_env``); elsewhere (AVX2 and AVX-512 x86, the
    CI machines) it logs that the binding is disabled and torch keeps its default pool, one thread
    per core the process may use. So OMP_NUM_THREADS sizes the pool on every CPU, and the binding
    pins it where SGLang binds. A user's own SGLANG_CPU_OMP_THREADS_BIND wins over the slice.

    `cores`: the cores of a node of the fleet's own (rollout/fleet/nodes.py), shared by the
    `num_engines` servers placed there; the trainer's OMP_NUM_THREADS does not apply to them.
    """
    share, threads = server_cores(index, num_engines, cores, overlapped=overlapped)
    env = {"OMP_NUM_THREADS": str(threads)}
    if CPU_BIND not in os.environ:
        env[CPU_BIND] = ",".join(str(c) for c in share)
    return env


def server_env(config: SGLangServerConfig) -> dict[str, str]:
    """Environment variables the server needs beyond the user's (config.env wins)."""
    # Log-probs of the sampling distribution softmax(logits / T), our contract (DESIGN.md).
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}
    if config.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    return {**env, **config.env}


def resolve_server_config(config: SGLangServerConfig, name: str) -> SGLangServerConfig:
    """Fill in what was left unset: host, free ports, a random API key, the log path.

    Args:
        config: the user's settings.
        name: engine name (names the default log file).

    Returns:
        A new config with every launch field set.
    """
    host = config.host or node_address()
    # A server on another node (launcher) binds an address this node does not have: its ports are
    # ones free here (rollout/fleet/nodes.py says why that serves).
    port_host = "" if config.launcher else host
    # Distinct ports, held open together while picked (two free_port calls can return one port).
    picked = free_ports(port_host, (not config.port) + (not config.nccl_port))
    python = config.python or sglang_python()
    if python is None:
        from megatron_dapo.errors import UserError

        raise UserError(f"rollout.engine=sglang: SGLang is not installed for this machine; {INSTALL_HINT}")
    return SGLangServerConfig(
        model_path=config.model_path,
        tp_size=config.tp_size,
        base_gpu_id=config.base_gpu_id,
        mem_fraction_static=config.mem_fraction_static,
        host=host,
        port=config.port or picked.pop(0),
        nccl_port=config.nccl_port or picked.pop(0),
        api_key=config.api_key or secrets.token_hex(24),
        dtype=config.dtype,
        random_seed=config.random_seed,
        log_path=config.log_path or str(Path.cwd() / f"sglang_{name}.log"),
        deterministic=config.deterministic,
        device=config.device,
        max_total_tokens=config.max_total_tokens,
        python=python,
        return_routes=config.return_routes,
        extra_args=config.extra_args,
        env=dict(config.env),
        launcher=tuple(config.launcher),
        releases_memory=config.releases_memory,
        lora_rank=config.lora_rank,
        lora_modules=tuple(config.lora_modules),
    )


def check_servable(model_path: str | Path) -> None:
    """Refuse, before a server starts, a checkpoint SGLang 0.5.18 would serve wrong without a word.

    Its ``Qwen3MoeDecoderLayer`` sets ``is_layer_sparse = True`` for every layer ("Qwen3MoE all
    layers are sparse", models/qwen3_moe.py), ignoring mlp_only_layers and decoder_sparse_step,
    and its load_weights drops a dense layer's mlp.{gate,up,down}_proj: a Qwen3-MoE with dense
    layers is served with experts where the checkpoint has a dense MLP (log-probs 4e-2 off in
    tests/sglang_cpu/test_sglang_moe.py). Qwen3-30B-A3B has none.

    Raises:
        UserError: a qwen3_moe config with a dense layer.
    """
    from megatron_dapo.errors import UserError

    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return  # the server reports an unreadable config at start
    if config.get("model_type") != "qwen3_moe":
        return
    layers = int(config.get("num_hidden_layers") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    dense = sorted({*config.get("mlp_only_layers", [])} | {i for i in range(layers) if (i + 1) % step})
    # transformers 5.19 writes num_local_experts for Qwen3-MoE; HF's published configs num_experts.
    if dense and int(config.get("num_experts") or config.get("num_local_experts") or 0) > 0:
        raise UserError(
            f"rollout.engine=sglang: {model_path} is a Qwen3-MoE with dense layers {dense} (mlp_only_layers / "
            "decoder_sparse_step), which SGLang 0.5.18 serves as MoE layers (its Qwen3MoeDecoderLayer makes every "
            "layer sparse and drops the dense weights): use rollout.engine=local or vllm, or a model without "
            "dense layers"
        )


def copies_lm_head(model_path: str | Path) -> bool:
    """Whether the trainer must send SGLang the tied output matrix as ``lm_head.weight`` too.

    sglang 0.5.18's Qwen3MoeForCausalLM builds its own ``lm_head`` (a ParallelLMHead) and never
    ties it to the embedding, whatever tie_word_embeddings says (models/qwen3_moe.py; its qwen2
    and qwen3 models do tie). A tied checkpoint has no ``lm_head.weight``, and the trainer's
    export sends the shared matrix once, as ``model.embed_tokens.weight``: the server would
    sample from an output layer nobody loaded (log-probs 0.18 off on the tiny MoE run,
    2026-11-27). So for a tied Qwen3-MoE the matrix also goes as ``lm_head.weight``
    (weights.with_lm_head_copy), before the first generation and at every sync.
    """
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return False
    return config.get("model_type") == "qwen3_moe" and bool(config.get("tie_word_embeddings"))
