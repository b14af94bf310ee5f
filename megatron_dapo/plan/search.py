"""Layout search: every TP / PP / EP / ETP / rollout-TP layout of the world, planned, and the one to use.

`megatron-dapo plan` prints the plan of the config's own layout and, after it, the layouts
that fit best (`format_search`), with the overrides that select the first. Candidates keep
communication-heavy groups inside a node: TP and the rollout TP divide the GPUs per node,
and so does EP x ETP (the MoE token alltoall); PP divides the layers; sequence parallelism
is on whenever TP > 1 (megatron-core's MoE layer needs it, and it only saves memory).
Everything else (CP, recompute, the micro-batch budget, rollout.gpu_memory_utilization)
stays as configured. The plans are model.make_plan's, so a recommendation is exactly as
good as the estimate: fitting layouts are ranked by step time, and because the estimate
leaves communication out, ties go to fewer TP x PP ranks, then ETP 1 (experts whole on a
GPU: no all-gather of routed tokens), then the most free memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from megatron_dapo.config import Config, ConfigError
from megatron_dapo.plan.dims import ModelDims
from megatron_dapo.plan.model import GIB, Assumptions, Hardware, Plan, make_plan


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One layout and its plan."""

    tp: int
    pp: int
    ep: int
    etp: int
    rollout_tp: int
    plan: Plan

    @property
    def peak_bytes(self) -> float:
        """The larger of the two phases' per-GPU memory."""
        return max(self.plan.train_phase_bytes, self.plan.rollout_phase_bytes)

    def overrides(self) -> list[str]:
        """The key=value overrides that select this layout."""
        out = [f"parallel.tensor_model_parallel_size={self.tp}", f"parallel.pipeline_model_parallel_size={self.pp}"]
        if self.plan.model.is_moe:
            out += [f"parallel.expert_model_parallel_size={self.ep}",
                    f"parallel.expert_tensor_parallel_size={self.etp}"]
        out += [f"parallel.sequence_parallel={str(self.tp > 1).lower()}",
                f"rollout.tensor_model_parallel_size={self.rollout_tp}"]
        return out

    def label(self) -> str:
        experts = f" EP {self.ep} ETP {self.etp}" if self.plan.model.is_moe else ""
        return f"TP {self.tp} PP {self.pp}{experts}, rollout TP {self.rollout_tp}"


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def candidate_layouts(dims: ModelDims, world: int, gpus_per_node: int,
                      cp: int = 1) -> Iterator[tuple[int, int, int, int, int]]:
    """(TP, PP, EP, ETP, rollout TP) layouts the model and the world can be split into."""
    node = _divisors(gpus_per_node)
    for tp in node:
        if dims.num_attention_heads % tp or dims.num_key_value_heads % tp:
            continue
        # Any PP up to the layer count: where it does not divide them the stages are uneven (plan/stages.py).
        for pp in range(1, dims.num_layers + 1):
            if world % (tp * pp * cp):
                continue
            if dims.is_moe:
                experts = [(ep, etp) for ep in _divisors(dims.num_experts) for etp in sorted({1, tp})
                           if gpus_per_node % (ep * etp) == 0 and world % (ep * etp * pp) == 0
                           and dims.moe_intermediate_size % etp == 0]
            else:
                experts = [(1, tp)]
            for ep, etp in experts:
                for rtp in node:
                    if dims.num_attention_heads % rtp == 0:
                        yield tp, pp, ep, etp, rtp


def search_layouts(cfg: Config, dims: ModelDims, *, nodes: int, gpus_per_node: int, hardware: Hardware,
                   assumptions: Assumptions | None = None) -> tuple[list[Candidate], int]:
    """Plan every candidate layout; return those that fit, best first, and how many were planned.

    Args:
        cfg: the experiment; its layout is replaced, everything else kept.
        dims: the model.
        nodes, gpus_per_node: the machine.
        hardware, assumptions: as for make_plan.

    Returns:
        (fitting candidates ranked as the module docstring says, number of layouts planned).
    """
    world = nodes * gpus_per_node
    fitting, planned = [], 0
    for tp, pp, ep, etp, rtp in candidate_layouts(dims, world, gpus_per_node, cfg.parallel.context_parallel_size):
        if cfg.trainer.ppo_mini_batch_size * cfg.rollout.n < world // (tp * pp * cfg.parallel.context_parallel_size):
            continue  # some data-parallel rank would get no sequence (check_world_size refuses it)
        parallel = dataclasses.replace(cfg.parallel, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                       expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                       sequence_parallel=tp > 1)
        layout = dataclasses.replace(cfg, parallel=parallel,
                                     rollout=dataclasses.replace(cfg.rollout, tensor_model_parallel_size=rtp))
        try:
            plan = make_plan(layout, dims, nodes=nodes, gpus_per_node=gpus_per_node, hardware=hardware,
                             assumptions=assumptions)
        except ConfigError:
            continue
        planned += 1
        if plan.fits:
            fitting.append(Candidate(tp=tp, pp=pp, ep=ep, etp=etp, rollout_tp=rtp, plan=plan))
    fitting.sort(key=lambda c: (round(c.plan.step_seconds, 3), c.tp * c.pp, c.etp, c.peak_bytes))
    return fitting, planned


def format_search(fitting: list[Candidate], planned: int, current: Plan, shown: int = 3) -> str:
    """The best layouts, where the config's own stands, and the overrides of the first."""
    if not fitting:
        return (f"layout search: none of {planned} layouts fits on {current.hardware.mem_gib:g} GiB GPUs "
                "(TP, rollout TP and EP x ETP within a node); add nodes, turn on model.recompute_activations, "
                "lower trainer.max_tokens_per_microbatch or rollout.gpu_memory_utilization")
    etp = current.etp if current.model.is_moe else current.tp
    mine = next((i for i, c in enumerate(fitting) if (c.tp, c.pp, c.ep, c.etp, c.rollout_tp)
                 == (current.tp, current.pp, current.ep, etp, current.rollout_tp)), None)
    rows = [f"layout search: {len(fitting)} of {planned} layouts fit (TP, rollout TP and EP x ETP within a node, "
            "SP when TP > 1); ranked by step time, then fewer TP x PP ranks and ETP 1 (communication is not "
            "estimated), then free memory"]
    for i, c in enumerate(fitting[:shown]):
        rows.append(f"  {i + 1}. {c.label()}: step {c.plan.step_seconds:.0f} s, train "
                    f"{c.plan.train_phase_bytes / GIB:.1f} GiB, rollout {c.plan.rollout_phase_bytes / GIB:.1f} GiB"
                    + ("   <- this config" if i == mine else ""))
    if mine is None:
        rows.append("  this config's layout: " + ("does not fit" if not current.fits else "fits, not ranked"))
    elif mine >= shown:
        rows.append(f"  this config's layout: rank {mine + 1} of {len(fitting)}")
    rows.append("recommended: " + " ".join(fitting[0].overrides()))
    return "\n".join(rows)
