"""The cluster split between the actor and a fleet of rollout engines (`megatron-dapo plan --engine-nodes K`).

model.py plans the colocated run, where the Megatron actor and an SGLang engine share every
GPU. A disaggregated run (rollout.placement=disaggregated) gives the engines nodes of their
own; this module plans that split with the same formulas, per side, and times its step as
docs/DESIGN.md models it ("What to expect on GPUs", the asynchronous loop).

The split. Of --nodes N nodes x G GPUs, --engine-nodes K whole nodes go to the engines and
the other N - K to the actor: N_e = K x G engine GPUs, N_a = (N - K) x G actor GPUs. The
fleet is rollout.num_engines servers of rollout.tensor_model_parallel_size GPUs when the
config says rollout.placement=disaggregated (they must fit in N_e; fewer leave GPUs idle,
with a warning), else as many as fill N_e (N_e / TP): a colocated config is planned as the
split it would become.

- **Actor GPUs** hold the actor alone (make_plan on the N - K nodes; no engine share): the
  train phase, and the weight sync's phase (model states + the largest tensor a source rank
  gathers + one bucket + overhead).
- **Engine GPUs**: SGLang sizes its pool from the memory free when it starts, here all but the
  overhead (CUDA context, NCCL buffers): weights N x 2 B / TP, a KV pool of f x (GPU - overhead)
  - weights (config/rollout.engine_memory_bytes), the overhead. The batch's tokens in flight
  are the sequences an engine decodes at once (model.in_flight) x the mean sequence.
- **Weight sync W**: the HF-named tensors of the whole model in the engine's dtype (bf16 on GPU:
  N x 2 B, unpadded vocabulary, every expert), broadcast over NCCL in one group per pipeline
  stage, each stage's first DP/TP rank sending its stage's tensors to every TP worker of every
  engine. A pipelined (ring) broadcast delivers B bytes to every receiver in about B / link
  bandwidth whatever the number of receivers, but a server takes one bucket at a time, so
  the stages take turns (rollout/fleet/stages.py; per-stage groups save the gather of every
  stage to one rank, not receive time): W = sum over stages of stage bytes / (sync_gbps x
  sync_efficiency) = N x 2 B / that rate. The default link is one InfiniBand NDR port, 400 Gb/s =
  50 GB/s, at 0.8 of it for NCCL's large-message broadcast (an assumption, like the MFU).
- **Step time**: G(N_e) generation on the engines (model.generation_line), U(N_a) the old
  log-probs and training on the actor's GPUs, W. With trainer.max_staleness >= 1 the engines
  generate the next batch while the actor trains and syncs: the steady step is
  max(G(N_e), U(N_a) + W); with 0 it is G(N_e) + U(N_a) + W. The colocated step the planner
  prints is G(N) + U(N): the colocation's hand-over C (memory release/resume, weight reload)
  is not modelled, so the ratio colocated / split leans toward colocation. Rewards and
  communication are left out on both sides.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megatron_dapo.config import Config, ConfigError
from megatron_dapo.plan import host
from megatron_dapo.plan.dims import ModelDims
from megatron_dapo.plan.model import (
    GIB,
    Assumptions,
    Hardware,
    Line,
    Plan,
    generation_line,
    in_flight,
    kv_bytes_per_token,
    make_plan,
    mean_lengths,
)
from megatron_dapo.plan.stages import stage_layers

__all__ = ["FleetPlan", "SyncLink", "check_fleet", "make_fleet_plan", "stage_sync_bytes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncLink:
    """The inter-node link the weight broadcast runs over (flags --sync-gbps, --sync-efficiency)."""

    gbps: float = 50.0
    """GB/s of one sender's link: an InfiniBand NDR port, 400 Gb/s."""
    efficiency: float = 0.8
    """Achieved fraction of it by NCCL's broadcast of large buckets."""


@dataclass(kw_only=True, slots=True)
class FleetPlan:
    """The numbers of the split; tests read these, users read report.format_fleet."""

    nodes: int
    engine_nodes: int
    gpus_per_node: int
    num_engines: int
    rollout_tp: int
    disaggregated: bool
    """Whether the config says rollout.placement=disaggregated (else the split is what-if)."""
    max_staleness: int
    """The config's trainer.max_staleness: which of the split's steps it would run."""
    actor: Plan
    """The actor alone on N - K nodes (its rollout phase does not exist here)."""
    colocated: Plan
    """The whole cluster colocated: what the planner prints above the split."""
    link: SyncLink
    engine_weight_bytes: float
    """N x 2 B / TP on one engine GPU."""
    kv_bytes_per_token: int
    engine_static_bytes: float
    """What the engine keeps for weights + KV pool on a GPU of its own."""
    engine_static_formula: str
    kv_tokens: int
    """KV pool per engine in tokens (0 if the weights leave no room)."""
    concurrent: int
    """Sequences an engine decodes at once."""
    mean_sequence_tokens: int
    engine_bytes: float
    """Engine GPU total: weights + pool + overhead."""
    refusal: str | None
    """SGLang's own words when it would not start, else None."""
    export_bytes: float
    """Largest tensor a sync's source rank gathers, on top of its parameters."""
    bucket_bytes: float
    actor_sync_phase_bytes: float
    stage_sync_bytes: tuple[int, ...]
    """HF-tensor bytes each pipeline stage sends per sync."""
    timing: list[Line] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def engine_gpus(self) -> int:
        return self.engine_nodes * self.gpus_per_node

    @property
    def actor_gpus(self) -> int:
        return (self.nodes - self.engine_nodes) * self.gpus_per_node

    @property
    def sync_bytes(self) -> int:
        return sum(self.stage_sync_bytes)

    @property
    def engine_fits(self) -> bool:
        return (self.refusal is None and self.kv_tokens >= self.actor.max_sequence_tokens
                and self.engine_bytes <= self.actor.gpu_bytes)

    @property
    def actor_fits(self) -> bool:
        return self.actor.train_fits and self.actor_sync_phase_bytes <= self.actor.gpu_bytes

    @property
    def fits(self) -> bool:
        return self.engine_fits and self.actor_fits

    def seconds(self, label: str) -> float:
        """The timing line of that label."""
        return next(line.value for line in self.timing if line.label == label)


def stage_sync_bytes(dims: ModelDims, pp: int, bytes_per_param: int = 2) -> tuple[int, ...]:
    """HF-tensor bytes each pipeline stage sends in one sync; they sum to num_params x bytes_per_param.

    A stage sends its layers (every expert), stage 0 the embedding (V x h, unpadded: HF names),
    the last stage the output layer (none when tied: HF holds one matrix) and the final norm.
    """
    sparse = set(dims.moe_layers) if dims.is_moe else set()
    h, vocab, out, first = dims.hidden_size, dims.vocab_size * dims.hidden_size, [], 0
    for stage, count in enumerate(stage_layers(dims.num_layers, pp)):
        params = sum(dims.layer_params(sparse=i in sparse) for i in range(first, first + count))
        first += count
        if stage == 0:
            params += vocab
        if stage == pp - 1:
            params += (0 if dims.tie_word_embeddings else vocab) + h
        out.append(params * bytes_per_param)
    return tuple(out)


def check_fleet(cfg: Config, dims: ModelDims, *, nodes: int, engine_nodes: int, gpus_per_node: int) -> int:
    """Reject a split that cannot run, in one line; return the number of engines.

    Raises:
        ConfigError: engine nodes not in [1, nodes - 1], an engine TP that does not divide the
            engine GPUs or the attention heads, or rollout.num_engines x TP more than the engine GPUs.
    """
    r = cfg.rollout
    rtp, engine_gpus = r.tensor_model_parallel_size, engine_nodes * gpus_per_node
    if not 1 <= engine_nodes < nodes:
        raise ConfigError(f"--engine-nodes={engine_nodes} of --nodes {nodes}: must be in [1, {nodes - 1}] "
                          "(the engines need a node, the actor keeps at least one)" if nodes > 1 else
                          f"--engine-nodes={engine_nodes} needs --nodes >= 2 (the engines and the actor on "
                          "nodes of their own)")
    where = f"the {engine_gpus} engine GPUs (--engine-nodes {engine_nodes} x --gpus-per-node {gpus_per_node})"
    if engine_gpus % rtp != 0 or dims.num_attention_heads % rtp != 0:
        raise ConfigError(f"rollout.tensor_model_parallel_size={rtp} must divide {where} and num_attention_heads="
                          f"{dims.num_attention_heads} of {dims.source}; use a common divisor")
    if r.placement != "disaggregated":
        return engine_gpus // rtp
    if r.num_engines * rtp > engine_gpus:
        raise ConfigError(f"rollout.num_engines x rollout.tensor_model_parallel_size = {r.num_engines}x{rtp} = "
                          f"{r.num_engines * rtp} GPUs, more than {where}; lower rollout.num_engines to "
                          f"{engine_gpus // rtp} or raise --engine-nodes to {-(-r.num_engines * rtp // gpus_per_node)}")
    return r.num_engines


def make_fleet_plan(cfg: Config, dims: ModelDims, *, nodes: int, engine_nodes: int, gpus_per_node: int,
                    hardware: Hardware, assumptions: Assumptions | None = None,
                    link: SyncLink | None = None) -> FleetPlan:
    """Plan `cfg` split into engine_nodes engine nodes and nodes - engine_nodes actor nodes.

    Args:
        cfg: the experiment, its trainer.nnodes = nodes (the colocated plan of the whole cluster).
        dims: the model.
        nodes, engine_nodes, gpus_per_node: the cluster and the engines' share of it.
        hardware, assumptions: as for make_plan.
        link: the weight broadcast's link (default SyncLink()).

    Returns:
        The split's plan, its colocated counterpart inside (`colocated`).

    Raises:
        ConfigError: check_fleet's refusals, then make_plan's for the actor's N - K nodes or the whole cluster.
    """
    a, link = assumptions or Assumptions(), link or SyncLink()
    r = cfg.rollout
    num_engines = check_fleet(cfg, dims, nodes=nodes, engine_nodes=engine_nodes, gpus_per_node=gpus_per_node)
    actor_nodes, rtp = nodes - engine_nodes, r.tensor_model_parallel_size
    actor_cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, nnodes=actor_nodes))
    actor_cfg.check_world_size(actor_nodes * gpus_per_node, f"the actor's {actor_nodes} node(s): --nodes {nodes} - "
                               f"--engine-nodes {engine_nodes}, x --gpus-per-node {gpus_per_node}")
    actor = make_plan(actor_cfg, dims, nodes=actor_nodes, gpus_per_node=gpus_per_node, hardware=hardware,
                      assumptions=a)
    colocated = make_plan(cfg, dims, nodes=nodes, gpus_per_node=gpus_per_node, hardware=hardware, assumptions=a)

    # Engine GPUs: nothing of the actor's is resident when SGLang starts, only the overhead.
    gpu, overhead = hardware.usable * GIB, a.overhead_gib * GIB
    weights = dims.num_params() * 2 / rtp
    kv_per_tok = kv_bytes_per_token(dims, rtp)
    static = r.engine_memory_bytes(gpu, overhead)
    kv_tokens = max(0, int((static - weights) // kv_per_tok))
    _, _, concurrent = in_flight(cfg, a, num_engines, kv_tokens)
    prompt, response = mean_lengths(cfg, a)

    # Actor GPUs during a sync: its states stay; a source rank gathers one tensor of its own stage at a time.
    export, _ = host.export_transient_bytes(dims, actor.tp, pp=1, ep=actor.ep)
    bucket = r.update_weights_bucket_megabytes << 20
    stages = stage_sync_bytes(dims, actor.pp)

    plan = FleetPlan(
        nodes=nodes, engine_nodes=engine_nodes, gpus_per_node=gpus_per_node, num_engines=num_engines,
        rollout_tp=rtp, disaggregated=r.placement == "disaggregated", max_staleness=cfg.trainer.max_staleness,
        actor=actor, colocated=colocated, link=link,
        engine_weight_bytes=weights, kv_bytes_per_token=kv_per_tok, engine_static_bytes=static, kv_tokens=kv_tokens,
        engine_static_formula=r.engine_memory_formula("overhead"),
        concurrent=concurrent, mean_sequence_tokens=prompt + response, engine_bytes=max(static, weights) + overhead,
        refusal=r.engine_refuses_to_start(static, weights), export_bytes=export, bucket_bytes=bucket,
        actor_sync_phase_bytes=actor.model_state_bytes + export + bucket + overhead, stage_sync_bytes=stages,
    )
    plan.timing = _timing(cfg, dims, hardware, a, plan)
    plan.warnings = _warnings(plan)
    return plan


def _timing(cfg: Config, dims: ModelDims, hw: Hardware, a: Assumptions, plan: FleetPlan) -> list[Line]:
    gen = generation_line(cfg, dims, hw, a, engines=plan.num_engines, rollout_tp=plan.rollout_tp,
                          kv_tokens=plan.kv_tokens)
    actor = {line.label: line.value for line in plan.actor.timing}
    update = actor["old/ref log-probs"] + actor["training"]
    rate = plan.link.gbps * 1e9 * plan.link.efficiency
    sync = sum(plan.stage_sync_bytes) / rate
    split = max(gen.value, update + sync)
    colocated = plan.colocated.step_seconds
    gib = [f"{b / GIB:.2f}" for b in plan.stage_sync_bytes]
    return [
        dataclasses.replace(gen, label="G(N_e) generation", formula=f"on {plan.engine_gpus} engine GPUs: "
                            + gen.formula),
        Line(label="U(N_a) update", value=update, unit="s",
             formula=f"on {plan.actor_gpus} actor GPUs: old/ref log-probs {actor['old/ref log-probs']:.0f} s + "
                     f"training {actor['training']:.0f} s (the actor's own plan, DP {plan.actor.dp})"),
        Line(label="W weight sync", value=sync, unit="s",
             formula=f"sum over the PP {plan.actor.pp} stage(s) of stage bytes [{', '.join(gib)} GiB] / "
                     f"({plan.link.gbps:g} GB/s x {plan.link.efficiency:g}); a group per stage, the stages in "
                     "turns (a server takes one bucket at a time)"),
        Line(label="split step", value=split, unit="s",
             formula="max(G(N_e), U(N_a) + W): trainer.max_staleness >= 1, the engines generate while the actor "
                     "trains"),
        Line(label="split, staleness 0", value=gen.value + update + sync, unit="s",
             formula="G(N_e) + U(N_a) + W: trainer.max_staleness=0, one after the other"),
        Line(label="colocated step", value=colocated, unit="s",
             formula=f"G(N) + U(N) on all {plan.colocated.world_size} GPUs, the plan above (hand-over C not "
                     "modelled)"),
        Line(label="colocated / split", value=colocated / split if split > 0 else math.inf, unit="x",
             formula="> 1: the split is faster at max_staleness >= 1"),
    ]


def _warnings(plan: FleetPlan) -> list[str]:
    out = []
    used = plan.num_engines * plan.rollout_tp
    if used < plan.engine_gpus:
        out.append(f"rollout.num_engines={plan.num_engines} x TP {plan.rollout_tp} uses {used} of the "
                   f"{plan.engine_gpus} engine GPUs; rollout.num_engines={plan.engine_gpus // plan.rollout_tp} "
                   "uses them all")
    if plan.refusal is not None:
        out.append(f"{plan.refusal}: its share of an engine GPU is below the "
                   f"{plan.engine_weight_bytes / GIB:.1f} GiB of weights; raise rollout.tensor_model_parallel_size")
    elif plan.kv_tokens < plan.actor.max_sequence_tokens:
        out.append(f"the KV pool holds {plan.kv_tokens} tokens per engine, less than one "
                   f"{plan.actor.max_sequence_tokens}-token sequence: raise rollout.tensor_model_parallel_size")
    return out
