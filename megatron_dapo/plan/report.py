"""Will this experiment fit, and roughly how long will a step take? Answered before a 128-GPU job queues.

`tools/plan.py CONFIG --nodes N --gpus-per-node G --gpu-mem-gib M [key=value ...]` prints,
per GPU, the memory of the Megatron actor (model states under megatron-core's
distributed optimizer, activations of one micro-batch with and without full recompute,
the logits and our chunked log-prob buffers) and of the colocated SGLang engine
(weights at the rollout TP size, KV-cache tokens left at rollout.gpu_memory_utilization),
whether each phase of the step fits, and a step-time estimate from FLOPs and HBM
bandwidth with its assumptions printed; then the layouts that fit best (search.py) and
the overrides of the first. Mixture-of-experts models add the experts' share: their
states over EP x ETP and the expert data-parallel group, top-k activations and alltoall
buffers, active-parameter FLOPs. `--ranks` adds the global-rank layout (which ranks form
the TP/PP/DP and EP groups, per node): the sbatch scripts print it with DRY_RUN=1.
`--engine-nodes K` adds the split of the nodes between the actor and a fleet of rollout
engines (fleet.py): each side's memory, the weight broadcast, and its step against this one.

Every formula is written next to its number in the output, so the table can be checked
by hand; tests/unit/test_plan.py does exactly that for Qwen2.5-32B. The estimate is
first-order: it ignores attention FLOPs, communication and weight-sync time, and
assumes fixed MFU and bandwidth efficiency. It is a sanity check, not a profiler.

The numbers come from model.py beside this module (the memory and step-time model, over
dims.py's model shape); this module formats them, lays out the ranks and parses the
command line.
"""

from __future__ import annotations

import argparse
import math

from megatron_dapo.config import ConfigError
from megatron_dapo.config.loader import load_config
from megatron_dapo.errors import CliParser
from megatron_dapo.plan import host
from megatron_dapo.plan.dims import EMBEDDED_VOCAB_SIZE, resolve_model
from megatron_dapo.plan.fleet import FleetPlan, SyncLink, make_fleet_plan
from megatron_dapo.plan.model import GIB, GPUS, Assumptions, Hardware, Plan, check_expert_layout, make_plan
from megatron_dapo.plan.search import format_search, search_layouts
from megatron_dapo.plan.stages import stage_layers

__all__ = ["build_parser", "expert_rank_coords", "format_fleet", "format_layout", "format_plan", "main", "rank_coords",
           "rank_groups", "run"]


# ------------------------------------------------------------------------ rank layout


def rank_coords(rank: int, tp: int, pp: int, cp: int, dp: int) -> tuple[int, int, int, int]:
    """(tp_rank, cp_rank, dp_rank, pp_rank) of a global rank in Megatron's tp-cp-ep-dp-pp order."""
    return rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp)


def expert_rank_coords(rank: int, etp: int, ep: int, edp: int) -> tuple[int, int, int]:
    """(etp_rank, ep_rank, edp_rank) of a global rank in megatron-core's expert grid (tp-ep-dp-pp, TP = ETP)."""
    return rank % etp, rank // etp % ep, rank // (etp * ep) % edp


def rank_groups(world: int, tp: int, pp: int, cp: int = 1, ep: int = 1,
                etp: int | None = None) -> dict[str, list[list[int]]]:
    """Global ranks of every TP, PP, CP and DP group (TP neighbours, PP outermost); with EP > 1
    or ETP != TP also the expert grid's EP, ETP and EDP (expert data-parallel) groups."""
    dp = world // (tp * pp * cp)
    groups: dict[str, dict[tuple[int, ...], list[int]]] = {"TP": {}, "PP": {}, "CP": {}, "DP": {}}
    etp = tp if etp is None else etp
    experts = ep > 1 or etp != tp
    edp = world // (ep * etp * pp)
    if experts:
        groups.update({"EP": {}, "ETP": {}, "EDP": {}})
    for rank in range(world):
        t, c, d, p = rank_coords(rank, tp, pp, cp, dp)
        groups["TP"].setdefault((c, d, p), []).append(rank)
        groups["CP"].setdefault((t, d, p), []).append(rank)
        groups["DP"].setdefault((t, c, p), []).append(rank)
        groups["PP"].setdefault((t, c, d), []).append(rank)
        if experts:
            et, e, ed = expert_rank_coords(rank, etp, ep, edp)
            groups["EP"].setdefault((et, ed, p), []).append(rank)
            groups["ETP"].setdefault((e, ed, p), []).append(rank)
            groups["EDP"].setdefault((et, e, p), []).append(rank)
    return {k: sorted(v.values()) for k, v in groups.items()}


def format_layout(world: int, tp: int, pp: int, cp: int, gpus_per_node: int, rollout_tp: int,
                  hosts: list[str] | None = None, ep: int = 1, etp: int | None = None) -> str:
    """The rank layout, per node, and the groups; what DRY_RUN=1 prints."""
    dp = world // (tp * pp * cp)
    etp = tp if etp is None else etp
    experts = ep > 1 or etp != tp
    edp = world // (ep * etp * pp)
    nodes = -(-world // gpus_per_node)
    hosts = hosts if hosts and len(hosts) == nodes else [f"node{i}" for i in range(nodes)]
    out = [f"rank layout: world {world} = TP {tp} x CP {cp} x DP {dp} x PP {pp} "
           "(Megatron order tp-cp-ep-dp-pp: TP ranks adjacent, PP outermost)"]
    if experts:
        out.append(f"expert layout: world {world} = ETP {etp} x EP {ep} x EDP {edp} x PP {pp} "
                   "(experts split over EP x ETP; their grads and optimizer states over EDP)")
    for node in range(nodes):
        ranks = range(node * gpus_per_node, min(world, (node + 1) * gpus_per_node))
        cells = []
        for rank in ranks:
            t, c, d, p = rank_coords(rank, tp, pp, cp, dp)
            expert = f" ep{expert_rank_coords(rank, etp, ep, edp)[1]}" if experts else ""
            cells.append(f"{rank}(tp{t} pp{p} dp{d}{expert}" + (f" cp{c})" if cp > 1 else ")"))
        out.append(f"node {node} {hosts[node]}: ranks {ranks[0]}-{ranks[-1]}: " + " ".join(cells))
    groups = rank_groups(world, tp, pp, cp, ep, etp)
    groups["rollout engine"] = [list(range(s, s + rollout_tp)) for s in range(0, world, rollout_tp)]
    for name in ("TP", "PP", "CP", "DP", "EP", "ETP", "EDP", "rollout engine"):
        if (name == "CP" and cp == 1) or name not in groups or (name == "ETP" and etp == 1):
            continue
        listed = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[name])
        out.append(f"{name} groups ({len(groups[name])}): {listed}")
    return "\n".join(out)


# ---------------------------------------------------------------------------- report


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f} GiB"


def _model_rows(plan: Plan) -> list[str]:
    m = plan.model
    shape = (f"(h {m.hidden_size}, F {m.intermediate_size}, L {m.num_layers}, heads {m.num_attention_heads}/"
             f"{m.num_key_value_heads} kv, d {m.head_dim}, V {m.vocab_size} -> padded {plan.padded_vocab}, "
             f"tied {m.tie_word_embeddings}" + (", QK-norm)" if m.qk_norm else ")"))
    if not m.is_moe:
        return [f"  {_count(plan.num_params)} params = L x {m.layer_params():,} + embeddings "
                f"{m.embedding_params():,} + {m.hidden_size} {shape}"]
    sparse, dense = m.num_moe_layers, m.num_layers - m.num_moe_layers
    k = m.num_experts_per_tok
    shared = f", shared expert F_s {m.shared_expert_intermediate_size}" if m.shared_expert_intermediate_size else ""
    return [
        f"  {_count(plan.num_params)} params = {sparse} MoE layers x {m.layer_params(sparse=True):,} + {dense} dense "
        f"layers x {m.layer_params():,} + embeddings {m.embedding_params():,} + {m.hidden_size} {shape}",
        f"  {_count(plan.num_active_params)} active per token = {sparse} x {m.layer_params(sparse=True, experts=k):,} "
        f"(attention, norms, router, top-{k} experts) + {dense} x {m.layer_params():,} + embeddings + h; "
        "FLOPs use these",
        f"  experts: {m.num_experts} per MoE layer x {m.expert_params():,} (3 x h x F_moe {m.moe_intermediate_size}), "
        f"top-{k}{shared}; {sparse} of {m.num_layers} layers sparse",
    ]


def _actor_rows(plan: Plan) -> list[str]:
    m, mb = plan.model, plan.microbatch_tokens
    states = f"{plan.params_per_gpu:,} params x {plan.bytes_per_param:.3f} B/param; B/param = " \
             f"{plan.bytes_per_param_formula}"
    per_token = f"{plan.act_bytes_per_token_layer:,.0f} B/token/layer x {mb} tokens / CP x {m.num_layers} layers"
    if m.is_moe:
        states = (f"dense {plan.params_per_gpu:,} x {plan.bytes_per_param:.3f} B ({plan.bytes_per_param_formula}) "
                  f"+ experts {plan.expert_params_per_gpu:,} x {plan.expert_bytes_per_param:.3f} B "
                  f"({plan.expert_bytes_per_param_formula}); experts = MoE layers/PP x E/EP {m.num_experts}/{plan.ep} "
                  f"x 3hF_moe/ETP {plan.etp}")
        dense = m.num_layers - m.num_moe_layers
        per_token = (f"({plan.moe_act_bytes_per_token_layer:,.0f} B/token x {m.num_moe_layers} MoE layers"
                     + (f" + {plan.act_bytes_per_token_layer:,.0f} x {dense} dense" if dense else "")
                     + f") x {mb} tokens / CP; MoE layer: k {m.num_experts_per_tok} routed copies x "
                     "(2h(ETP+1) + 6F_moe)/TP + router 7E/TP, balanced routing")
    if plan.lora_rank:
        base = plan.params_per_gpu + plan.expert_params_per_gpu
        states = (f"frozen base {base:,} params x {plan.lora_base_bytes_per_param} B (no grad, no optimizer) + LoRA "
                  f"r={plan.lora_rank} {plan.lora_params_per_gpu:,} params x {plan.bytes_per_param:.3f} B "
                  f"({plan.bytes_per_param_formula}); adapter-only sync {_gib(plan.lora_sync_bytes)} per engine")
    rows = [
        f"  model states      {_gib(plan.model_state_bytes)}  {states}",
        f"  activations       {_gib(plan.activation_bytes)}  no recompute: {per_token}"
        + ("" if plan.recompute else "   <- used"),
        f"  act. (recompute)  {_gib(plan.activation_recompute_bytes)}  full recompute: layer inputs 2h/t x tokens x L "
        "+ one layer's activations" + ("   <- used" if plan.recompute else ""),
        f"  logits + grad     {_gib(plan.logits_bytes)}  2 x {mb} tokens x V_pad/TP x 4 B (fp32)",
        f"  log-prob chunks   {_gib(plan.logprob_chunk_bytes)}  3 x chunk x V_pad/TP x 4 B",
    ]
    if m.is_moe:
        rows.append(f"  alltoall buffers  {_gib(plan.dispatch_bytes)}  one layer's send + receive: k x tokens/CP/TP "
                    "x (1 + ETP) x h x 2 B")
    return rows


def _host_rows(plan: Plan) -> list[str]:
    convert, convert_formula = host.converter_peak_bytes(plan.model, plan.tp)
    export, export_formula = host.export_transient_bytes(plan.model, plan.tp, pp=plan.pp, ep=plan.ep)
    restart = host.restart_copy_bytes(plan.model)
    leaders = max(1, plan.gpus_per_node // plan.rollout_tp)
    rows = [
        f"  convert (1 proc.) {_gib(convert)}  peak RSS of `megatron-dapo convert` either way: {convert_formula}",
        f"  weight export     {_gib(export)}  per actor rank, on its device, on top of its weights: {export_formula}",
        f"  engine restarts   {_gib(restart)}  pinned host memory per engine leader while rollout.max_engine_restarts "
        f"> 0: N x 2 B, one reused copy in exactly pinned blocks, + at most one block's tail ("
        f"{host.RESTART_ARENA_TAIL_BYTES / GIB:g} GiB); x {leaders} leader(s) per node = "
        f"{restart * leaders / GIB:.2f} GiB",
    ]
    routes = host.routes_buffer_bytes(plan.model, plan.kv_tokens)
    if routes:
        workers = leaders * plan.rollout_tp
        rows.append(f"  routed experts    {_gib(routes)}  pinned host memory per SGLang TP worker with "
                    f"algorithm.routing_replay on: {plan.kv_tokens} KV tokens x {plan.model.num_layers} layers x "
                    f"top-{plan.model.num_experts_per_tok} x 4 B; x {workers} TP worker(s) per node "
                    f"({leaders} engine(s) x TP {plan.rollout_tp}) = {routes * workers / GIB:.2f} GiB")
    return rows


def format_plan(plan: Plan) -> str:
    """The human-readable report."""
    m, hw, a = plan.model, plan.hardware, plan.assumptions
    experts = f" EP {plan.ep} ETP {plan.etp} (expert DP {plan.edp})" if m.is_moe else ""
    rows = [
        f"model: {m.name} from {m.source}",
        *_model_rows(plan),
        f"layout: {plan.nodes} nodes x {plan.gpus_per_node} GPUs = {plan.world_size}; actor TP {plan.tp} PP {plan.pp} "
        f"CP {plan.cp} DP {plan.dp}{experts}; rollout engines TP {plan.rollout_tp} x "
        f"{plan.world_size // plan.rollout_tp}",
        *_stage_rows(plan),
        f"GPU: {hw.name}, {hw.mem_gib:g} GiB ({hw.usable:g} GiB usable by a process: what every budget below divides)",
        "",
        "actor, per GPU (fullest pipeline stage)",
        *_actor_rows(plan),
        f"  overhead          {_gib(a.overhead_gib * GIB)}  CUDA contexts, NCCL, fragmentation (--overhead-gib)",
        f"  train phase       {_gib(plan.train_phase_bytes)}  {'fits' if plan.train_fits else 'DOES NOT FIT'} "
        f"in {hw.usable:g} GiB",
        "",
        "rollout (SGLang, colocated), per GPU",
        f"  engine weights    {_gib(plan.rollout_weight_bytes)}  N x 2 B / rollout TP {plan.rollout_tp}"
        + (" (all experts)" if m.is_moe else ""),
        f"  KV per token      {plan.kv_bytes_per_token:>8,} B    2 x L x max(1, kv_heads/TP) x d x 2 B",
        f"  KV capacity       {plan.kv_tokens:>8,} tokens per engine = {plan.kv_tokens // plan.max_sequence_tokens} "
        f"sequences of {plan.max_sequence_tokens} (mem_fraction x free at start - weights) / KV per token",
        "                    (SGLang sizes from the memory free when it starts: usable GPU - what training holds then -",
        "                     overhead; the actor's weights, grads, fp32 masters and Adam moments all exist then: the",
        "                     run makes the optimizer state and loads a resumed checkpoint before the engines start)",
        f"  rollout phase     {_gib(plan.rollout_phase_bytes)}  actor model states + engine + overhead: "
        f"{'fits' if plan.rollout_fits else 'DOES NOT FIT'}",
        "",
        "host memory: conversion and weight export (benchmarks/scale.py measured both at these shapes, 2 layers, on CPU), restarts",
        *_host_rows(plan),
        "",
        f"verdict: {'FITS' if plan.fits else 'DOES NOT FIT'} on {hw.mem_gib:g} GiB GPUs ({hw.usable:g} GiB usable)",
        "",
        f"step time estimate (peak {hw.peak_tflops:g} TFLOP/s bf16 dense, MFU {a.mfu:g}, HBM {hw.hbm_gbps:g} GB/s x "
        f"{a.hbm_efficiency:g}, {a.gen_rounds:g} generation round(s); attention FLOPs, communication and weight "
        "sync ignored)",
    ]
    rows += [f"  {line.label:<18}{line.value:8.0f} {line.unit}  {line.formula}" for line in plan.timing]
    rows += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(rows)


def format_fleet(f: FleetPlan) -> str:
    """The split's report: actor and engine GPUs, the weight sync, the step against the colocated one."""
    a, mem = f.actor, f.actor.hardware.usable
    overhead = a.assumptions.overhead_gib * GIB
    seq = f.mean_sequence_tokens
    what_if = "" if f.disaggregated else (f" (the config is colocated: planned as rollout.placement=disaggregated "
                                          f"rollout.num_engines={f.num_engines})")
    rows = [
        f"disaggregated split: --engine-nodes {f.engine_nodes} of {f.nodes} nodes x {f.gpus_per_node} GPUs: actor "
        f"{f.actor_gpus} GPUs (TP {a.tp} PP {a.pp} CP {a.cp} DP {a.dp}), engines {f.num_engines} x TP "
        f"{f.rollout_tp} on {f.engine_gpus} GPUs{what_if}",
        "",
        "actor GPUs, per GPU (the actor alone: no engine beside it)",
        _actor_rows(a)[0],
        f"  train phase       {_gib(a.train_phase_bytes)}  states + activations + logits + log-prob chunks"
        f"{' + alltoall buffers' if a.model.is_moe else ''} + overhead: {'fits' if a.train_fits else 'DOES NOT FIT'} "
        f"in {mem:g} GiB",
        f"  weight sync phase {_gib(f.actor_sync_phase_bytes)}  states + largest gathered tensor "
        f"{f.export_bytes / GIB:.2f} + one bucket {f.bucket_bytes / GIB:.2f} + overhead: "
        f"{'fits' if f.actor_sync_phase_bytes <= a.gpu_bytes else 'DOES NOT FIT'}",
        "",
        "engine GPUs, per GPU (SGLang on GPUs of its own: only the overhead is resident when it starts)",
        f"  engine weights    {_gib(f.engine_weight_bytes)}  N x 2 B / rollout TP {f.rollout_tp}"
        + (" (all experts)" if a.model.is_moe else ""),
        f"  KV pool           {_gib(max(0.0, f.engine_static_bytes - f.engine_weight_bytes))}  "
        f"{f.engine_static_formula} - weights = {f.kv_tokens:,} tokens per engine at {f.kv_bytes_per_token:,} B/token "
        f"= {f.kv_tokens // a.max_sequence_tokens} sequences of {a.max_sequence_tokens}",
        f"  KV in flight      {_gib(f.concurrent * seq * f.kv_bytes_per_token)}  {f.concurrent} sequences at once "
        f"(min(responses per engine, pool / mean sequence)) x {seq} mean tokens x KV per token",
        f"  overhead          {_gib(overhead)}  CUDA context, NCCL, fragmentation (--overhead-gib)",
        f"  engine GPU        {_gib(f.engine_bytes)}  weights + KV pool + overhead: "
        f"{'fits' if f.engine_fits else 'DOES NOT FIT'} in {mem:g} GiB",
        "",
        f"weight sync: {_gib(f.sync_bytes).strip()} per sync = N x 2 B, the HF-named tensors in bf16 (unpadded "
        f"vocabulary{', all experts' if a.model.is_moe else ''}), from each stage's first rank to every engine",
        "",
        f"step time of the split (this config: trainer.max_staleness={f.max_staleness}; --sync-gbps "
        f"{f.link.gbps:g} x --sync-efficiency {f.link.efficiency:g})",
    ]
    # Seconds above 10 to the second, a sync of a second or less and the ratio to two digits.
    rows += [f"  {line.label:<20}{line.value:8.{0 if line.value >= 10 else 2}f} {line.unit}  {line.formula}"
             for line in f.timing]
    rows += [f"warning: {w}" for w in f.warnings]
    rows.append(f"split verdict: {'FITS' if f.fits else 'DOES NOT FIT'} (actor GPUs "
                f"{'fit' if f.actor_fits else 'do not fit'}, engine GPUs {'fit' if f.engine_fits else 'do not fit'})")
    return "\n".join(rows)


# ------------------------------------------------------------------------------- CLI


def _stage_rows(plan: Plan) -> list[str]:
    """The pipeline split, when PP does not divide the layers (megatron_dapo/plan/stages.py chooses it)."""
    split = stage_layers(plan.model.num_layers, plan.pp)
    if len(set(split)) == 1:
        return []
    middle = f" + {len(split) - 2} x {split[1]}" if len(split) > 2 else ""
    return [f"pipeline stages: {split[0]}{middle} + {split[-1]} layers (PP {plan.pp} does not divide "
            f"{plan.model.num_layers}: uneven stages, the fullest one sets the pace)"]


def build_parser() -> argparse.ArgumentParser:
    defaults = Assumptions()

    parser = CliParser(prog="megatron-dapo plan", description=__doc__.split("\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  megatron-dapo plan examples/dapo_qwen2.5_32b.yaml --nodes 16 --gpus-per-node 8 "
                              "--gpu-mem-gib 80\n  megatron-dapo plan examples/dapo_qwen2.5_32b.yaml --nodes 8 "
                              "--engine-nodes 4")
    parser.add_argument("config", help="experiment YAML, e.g. examples/dapo_qwen2.5_32b.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_model_parallel_size=4")
    parser.add_argument("--nodes", type=int, default=None, help="nodes (default: trainer.nnodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: trainer.n_gpus_per_node or 8)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="GPU preset for memory, peak and bandwidth")
    parser.add_argument("--gpu-mem-gib", type=float, default=None, help="GPU memory in GiB (default: the preset's)")
    parser.add_argument("--gpu-usable-gib", type=float, default=None,
                        help="what one process can allocate, e.g. torch.cuda.mem_get_info()[1] / 2**30 on an idle GPU "
                             "(default: the preset's; H100 79.6 of 80)"),
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: the preset's)")
    parser.add_argument("--hbm-gbps", type=float, default=None, help="HBM bandwidth in GB/s (default: the preset's)")
    parser.add_argument("--mfu", type=float, default=defaults.mfu, help="achieved fraction of peak FLOP/s")
    parser.add_argument("--hbm-efficiency", type=float, default=defaults.hbm_efficiency,
                        help="achieved fraction of HBM bandwidth in decode")
    parser.add_argument("--avg-prompt-tokens", type=int, default=None, help="default: data.max_prompt_length / 8")
    parser.add_argument("--avg-response-tokens", type=int, default=None, help="default: data.max_response_length / 4")
    parser.add_argument("--gen-rounds", type=float, default=defaults.gen_rounds,
                        help="generation rounds per step (dynamic sampling)")
    parser.add_argument("--overhead-gib", type=float, default=defaults.overhead_gib,
                        help="per-GPU memory not modelled (contexts, NCCL, fragmentation)")
    parser.add_argument("--model-config", default=None,
                        help="bundled model name (examples/model_configs/<name>.json) or a config.json path")
    parser.add_argument("--vocab-size", type=int, default=EMBEDDED_VOCAB_SIZE, help="vocabulary of a scratch model")
    parser.add_argument("--ranks", action="store_true", help="also print the global-rank layout per node")
    parser.add_argument("--layout-only", action="store_true", help="print only the rank layout")
    parser.add_argument("--hosts", default=None, help="comma-separated node names for the layout")
    parser.add_argument("--engine-nodes", type=int, default=None, metavar="K",
                        help="also plan the disaggregated split: K of the --nodes go to rollout engines, the rest to "
                             "the actor; the engines are rollout.num_engines x rollout.tensor_model_parallel_size "
                             "GPUs with rollout.placement=disaggregated, else as many engines as fill the K nodes")
    parser.add_argument("--sync-gbps", type=float, default=SyncLink().gbps,
                        help="GB/s of a weight-sync sender's link (default 50: one InfiniBand NDR port, 400 Gb/s)")
    parser.add_argument("--sync-efficiency", type=float, default=SyncLink().efficiency,
                        help="achieved fraction of --sync-gbps in NCCL's broadcast (default 0.8)")
    parser.add_argument("--no-search", action="store_true",
                        help="skip the search over TP/PP/EP/rollout-TP layouts that ends the report")
    return parser


def run(argv: list[str] | None = None) -> int:
    """tools/plan.py: print the plan (and layout); exit 2 with one line on bad input."""
    args = build_parser().parse_intermixed_args(argv)
    # NaN fails every comparison, so each rule is written as what holds, then negated.
    for name in ("nodes", "gpus_per_node", "gpu_mem_gib", "gpu_usable_gib", "peak_tflops", "hbm_gbps", "avg_prompt_tokens",
                 "avg_response_tokens", "vocab_size"):
        value = getattr(args, name)
        if value is not None and not (0 < value < math.inf):
            raise ConfigError(f"--{name.replace('_', '-')}={value}: must be a finite number > 0")
    if not 0 < args.sync_gbps < math.inf:
        raise ConfigError(f"--sync-gbps={args.sync_gbps}: must be a finite number > 0")
    for name in ("mfu", "hbm_efficiency", "sync_efficiency"):
        if not 0 < getattr(args, name) <= 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be in (0, 1]")
    if not 1 <= args.gen_rounds < math.inf:
        raise ConfigError(f"--gen-rounds={args.gen_rounds}: must be >= 1 (generation rounds per RL step; "
                          "dynamic sampling makes it 1-3 in practice)")
    if not 0 <= args.overhead_gib < math.inf:
        raise ConfigError(f"--overhead-gib={args.overhead_gib}: must be a finite number >= 0")
    base = load_config(args.config, args.overrides)
    nodes = args.nodes or base.trainer.nnodes
    gpus = args.gpus_per_node or base.trainer.n_gpus_per_node or 8
    # The flags describe the machine being planned for: they replace the config's launch shape.
    cfg = load_config(args.config, [*args.overrides, f"trainer.nnodes={nodes}", f"trainer.n_gpus_per_node={gpus}"])
    p = cfg.parallel
    hosts = args.hosts.split(",") if args.hosts else None
    if hosts is not None and (len(hosts) != nodes or not all(h.strip() for h in hosts)):
        raise ConfigError(f"--hosts names {len(hosts)} node(s) ({args.hosts!r}) for {nodes} node(s); give one "
                          "non-empty name per node, comma-separated")
    etp = p.expert_tensor_parallel_size
    if args.layout_only and args.engine_nodes is not None:
        raise ConfigError(f"--engine-nodes={args.engine_nodes} plans the split's memory and step time, which "
                          "--layout-only does not print; drop one of them")
    if args.layout_only:
        where = f"--nodes {nodes} x --gpus-per-node {gpus}"
        cfg.check_world_size(nodes * gpus, where)
        if p.expert_model_parallel_size > 1 or etp is not None:
            check_expert_layout(p, resolve_model(cfg, args.model_config, args.vocab_size), nodes * gpus, where)
        print(format_layout(nodes * gpus, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                            p.context_parallel_size, gpus, cfg.rollout.tensor_model_parallel_size, hosts,
                            p.expert_model_parallel_size, etp))
        return 0
    preset = GPUS[args.gpu]
    hardware = Hardware(
        name=preset.name if args.gpu_mem_gib in (None, preset.mem_gib) else f"{preset.name}, memory set to",
        mem_gib=args.gpu_mem_gib or preset.mem_gib,
        usable_gib=args.gpu_usable_gib or (preset.usable_gib if args.gpu_mem_gib in (None, preset.mem_gib) else None),
        peak_tflops=args.peak_tflops or preset.peak_tflops,
        hbm_gbps=args.hbm_gbps or preset.hbm_gbps,
    )
    assumptions = Assumptions(mfu=args.mfu, hbm_efficiency=args.hbm_efficiency, avg_prompt_tokens=args.avg_prompt_tokens,
                              avg_response_tokens=args.avg_response_tokens, gen_rounds=args.gen_rounds,
                              overhead_gib=args.overhead_gib)
    dims = resolve_model(cfg, args.model_config, args.vocab_size)
    fleet = None
    if args.engine_nodes is not None:
        # Planned before anything is printed: a refused split is one line on stderr, nothing on stdout.
        fleet = make_fleet_plan(cfg, dims, nodes=nodes, engine_nodes=args.engine_nodes, gpus_per_node=gpus,
                                hardware=hardware, assumptions=assumptions,
                                link=SyncLink(gbps=args.sync_gbps, efficiency=args.sync_efficiency))
        plan = fleet.colocated
    else:
        plan = make_plan(cfg, dims, nodes=nodes, gpus_per_node=gpus, hardware=hardware, assumptions=assumptions)
    if args.ranks:
        print(format_layout(plan.world_size, plan.tp, plan.pp, plan.cp, gpus, plan.rollout_tp, hosts, plan.ep,
                            plan.etp if dims.is_moe else None))
        print()
    print(format_plan(plan))
    if fleet is not None:
        print()
        print(format_fleet(fleet))
    if not args.no_search:
        fitting, planned = search_layouts(cfg, dims, nodes=nodes, gpus_per_node=gpus, hardware=hardware,
                                          assumptions=assumptions)
        print()
        print(format_search(fitting, planned, plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point with the CLI's error convention: one line on stderr, exit code 2."""
    import sys

    from megatron_dapo.errors import EXIT_USER_ERROR, UserError

    try:
        return run(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
