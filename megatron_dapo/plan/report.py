"""Will this experiment fit, and roughly how long will a step take? Answered before a 128-GPU job queues.

`tools/plan.py CONFIG --nodes N --gpus-per-node G --gpu-mem-gib M [key=value ...]` prints,
per GPU, the memory of the Megatron actor (model states under megatron-core's
distributed optimizer, activations of one micro-batch with and without full recompute,
the logits and our chunked log-prob buffers) and of the colocated SGLang engine
(weights at the rollout TP size, KV-cache tokens left at rollout.gpu_memory_utilization),
whether each phase of the step fits, and a step-time estimate from FLOPs and HBM
bandwidth with its assumptions printed. `--ranks` adds the global-rank layout (which
ranks form the TP/PP/DP groups, per node): the sbatch scripts print it with DRY_RUN=1.

Every formula is written next to its number in the output, so the table can be checked
by hand; tests/unit/test_plan.py does exactly that for Qwen2.5-32B. The estimate is
first-order: it ignores attention FLOPs, communication and weight-sync time, and
assumes fixed MFU and bandwidth efficiency. It is a sanity check, not a profiler.

The numbers come from model.py beside this module (the memory and step-time model);
this module formats them, lays out the ranks and parses the command line.
"""

from __future__ import annotations

import argparse

from megatron_dapo.config import ConfigError
from megatron_dapo.config.loader import load_config
from megatron_dapo.errors import CliParser
from megatron_dapo.plan.model import (
    EMBEDDED_VOCAB_SIZE,
    GIB,
    GPUS,
    Assumptions,
    Hardware,
    Plan,
    make_plan,
    resolve_model,
)

__all__ = ["build_parser", "format_layout", "format_plan", "main", "rank_coords", "rank_groups", "run"]


# ------------------------------------------------------------------------ rank layout


def rank_coords(rank: int, tp: int, pp: int, cp: int, dp: int) -> tuple[int, int, int, int]:
    """(tp_rank, cp_rank, dp_rank, pp_rank) of a global rank in Megatron's tp-cp-ep-dp-pp order."""
    return rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp)


def rank_groups(world: int, tp: int, pp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """Global ranks of every TP, PP, CP and DP group (TP neighbours, PP outermost)."""
    dp = world // (tp * pp * cp)
    groups: dict[str, dict[tuple[int, ...], list[int]]] = {"TP": {}, "PP": {}, "CP": {}, "DP": {}}
    for rank in range(world):
        t, c, d, p = rank_coords(rank, tp, pp, cp, dp)
        groups["TP"].setdefault((c, d, p), []).append(rank)
        groups["CP"].setdefault((t, d, p), []).append(rank)
        groups["DP"].setdefault((t, c, p), []).append(rank)
        groups["PP"].setdefault((t, c, d), []).append(rank)
    return {k: sorted(v.values()) for k, v in groups.items()}


def format_layout(world: int, tp: int, pp: int, cp: int, gpus_per_node: int, rollout_tp: int,
                  hosts: list[str] | None = None) -> str:
    """The rank layout, per node, and the groups; what DRY_RUN=1 prints."""
    dp = world // (tp * pp * cp)
    nodes = -(-world // gpus_per_node)
    hosts = hosts if hosts and len(hosts) == nodes else [f"node{i}" for i in range(nodes)]
    out = [f"rank layout: world {world} = TP {tp} x CP {cp} x DP {dp} x PP {pp} "
           "(Megatron order tp-cp-ep-dp-pp: TP ranks adjacent, PP outermost)"]
    for node in range(nodes):
        ranks = range(node * gpus_per_node, min(world, (node + 1) * gpus_per_node))
        cells = []
        for rank in ranks:
            t, c, d, p = rank_coords(rank, tp, pp, cp, dp)
            cells.append(f"{rank}(tp{t} pp{p} dp{d}" + (f" cp{c})" if cp > 1 else ")"))
        out.append(f"node {node} {hosts[node]}: ranks {ranks[0]}-{ranks[-1]}: " + " ".join(cells))
    groups = rank_groups(world, tp, pp, cp)
    groups["rollout engine"] = [list(range(s, s + rollout_tp)) for s in range(0, world, rollout_tp)]
    for name in ("TP", "PP", "CP", "DP", "rollout engine"):
        if name == "CP" and cp == 1:
            continue
        listed = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[name])
        out.append(f"{name} groups ({len(groups[name])}): {listed}")
    return "\n".join(out)


# ---------------------------------------------------------------------------- report


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f} GiB"


def format_plan(plan: Plan) -> str:
    """The human-readable report."""
    m, hw, a = plan.model, plan.hardware, plan.assumptions
    mb = plan.microbatch_tokens
    rows = [
        f"model: {m.name} from {m.source}",
        f"  {_count(plan.num_params)} params = L x {m.layer_params():,} + embeddings {m.embedding_params():,} "
        f"+ {m.hidden_size} (h {m.hidden_size}, F {m.intermediate_size}, L {m.num_layers}, heads "
        f"{m.num_attention_heads}/{m.num_key_value_heads} kv, d {m.head_dim}, V {m.vocab_size} -> padded "
        f"{plan.padded_vocab}, tied {m.tie_word_embeddings})",
        f"layout: {plan.nodes} nodes x {plan.gpus_per_node} GPUs = {plan.world_size}; actor TP {plan.tp} PP {plan.pp} "
        f"CP {plan.cp} DP {plan.dp}; rollout engines TP {plan.rollout_tp} x {plan.world_size // plan.rollout_tp}",
        f"GPU: {hw.name}, {hw.mem_gib:g} GiB",
        "",
        "actor, per GPU (fullest pipeline stage)",
        f"  model states      {_gib(plan.model_state_bytes)}  {plan.params_per_gpu:,} params x "
        f"{plan.bytes_per_param:.3f} B/param; B/param = {plan.bytes_per_param_formula}",
        f"  activations       {_gib(plan.activation_bytes)}  no recompute: {plan.act_bytes_per_token_layer:,.0f} "
        f"B/token/layer x {mb} tokens / CP x {m.num_layers} layers" + ("" if plan.recompute else "   <- used"),
        f"  act. (recompute)  {_gib(plan.activation_recompute_bytes)}  full recompute: layer inputs 2h/t x tokens x L "
        "+ one layer's activations" + ("   <- used" if plan.recompute else ""),
        f"  logits + grad     {_gib(plan.logits_bytes)}  2 x {mb} tokens x V_pad/TP x 4 B (fp32)",
        f"  log-prob chunks   {_gib(plan.logprob_chunk_bytes)}  3 x chunk x V_pad/TP x 4 B",
        f"  overhead          {_gib(a.overhead_gib * GIB)}  CUDA contexts, NCCL, fragmentation (--overhead-gib)",
        f"  train phase       {_gib(plan.train_phase_bytes)}  {'fits' if plan.train_fits else 'DOES NOT FIT'} "
        f"in {hw.mem_gib:g} GiB",
        "",
        "rollout (SGLang, colocated), per GPU",
        f"  engine weights    {_gib(plan.rollout_weight_bytes)}  N x 2 B / rollout TP {plan.rollout_tp}",
        f"  KV per token      {plan.kv_bytes_per_token:>8,} B    2 x L x max(1, kv_heads/TP) x d x 2 B",
        f"  KV capacity       {plan.kv_tokens:>8,} tokens per engine = {plan.kv_tokens // plan.max_sequence_tokens} "
        f"sequences of {plan.max_sequence_tokens} (mem_fraction x GPU - weights) / KV per token",
        f"  rollout phase     {_gib(plan.rollout_phase_bytes)}  actor model states + mem_fraction x GPU + overhead: "
        f"{'fits' if plan.rollout_fits else 'DOES NOT FIT'}",
        "",
        f"verdict: {'FITS' if plan.fits else 'DOES NOT FIT'} on {hw.mem_gib:g} GiB GPUs",
        "",
        f"step time estimate (peak {hw.peak_tflops:g} TFLOP/s bf16 dense, MFU {a.mfu:g}, HBM {hw.hbm_gbps:g} GB/s x "
        f"{a.hbm_efficiency:g}, {a.gen_rounds:g} generation round(s); attention FLOPs, communication and weight "
        "sync ignored)",
    ]
    rows += [f"  {line.label:<18}{line.value:8.0f} {line.unit}  {line.formula}" for line in plan.timing]
    rows += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(rows)


# ------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    defaults = Assumptions()

    parser = CliParser(prog="megatron-dapo plan", description=__doc__.split("\n")[0])
    parser.add_argument("config", help="experiment YAML, e.g. examples/dapo_qwen2.5_32b.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_model_parallel_size=4")
    parser.add_argument("--nodes", type=int, default=None, help="nodes (default: trainer.nnodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: trainer.n_gpus_per_node or 8)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="GPU preset for memory, peak and bandwidth")
    parser.add_argument("--gpu-mem-gib", type=float, default=None, help="GPU memory in GiB (default: the preset's)")
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
    return parser


def run(argv: list[str] | None = None) -> int:
    """tools/plan.py: print the plan (and layout); exit 2 with one line on bad input."""
    args = build_parser().parse_intermixed_args(argv)
    for name in ("nodes", "gpus_per_node", "gpu_mem_gib", "peak_tflops", "hbm_gbps", "avg_prompt_tokens",
                 "avg_response_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}={value}: must be > 0")
    if not 0 < args.mfu <= 1 or not 0 < args.hbm_efficiency <= 1:
        raise ConfigError(f"--mfu={args.mfu} / --hbm-efficiency={args.hbm_efficiency}: must be in (0, 1]")
    base = load_config(args.config, args.overrides)
    nodes = args.nodes or base.trainer.nnodes
    gpus = args.gpus_per_node or base.trainer.n_gpus_per_node or 8
    # The flags describe the machine being planned for: they replace the config's launch shape.
    cfg = load_config(args.config, [*args.overrides, f"trainer.nnodes={nodes}", f"trainer.n_gpus_per_node={gpus}"])
    p = cfg.parallel
    hosts = args.hosts.split(",") if args.hosts else None
    if args.layout_only:
        cfg.check_world_size(nodes * gpus, f"--nodes {nodes} x --gpus-per-node {gpus}")
        print(format_layout(nodes * gpus, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                            p.context_parallel_size, gpus, cfg.rollout.tensor_model_parallel_size, hosts))
        return 0
    preset = GPUS[args.gpu]
    hardware = Hardware(
        name=preset.name if args.gpu_mem_gib in (None, preset.mem_gib) else f"{preset.name}, memory set to",
        mem_gib=args.gpu_mem_gib or preset.mem_gib,
        peak_tflops=args.peak_tflops or preset.peak_tflops,
        hbm_gbps=args.hbm_gbps or preset.hbm_gbps,
    )
    assumptions = Assumptions(mfu=args.mfu, hbm_efficiency=args.hbm_efficiency, avg_prompt_tokens=args.avg_prompt_tokens,
                              avg_response_tokens=args.avg_response_tokens, gen_rounds=args.gen_rounds,
                              overhead_gib=args.overhead_gib)
    dims = resolve_model(cfg, args.model_config, args.vocab_size)
    plan = make_plan(cfg, dims, nodes=nodes, gpus_per_node=gpus, hardware=hardware, assumptions=assumptions)
    if args.ranks:
        print(format_layout(plan.world_size, plan.tp, plan.pp, plan.cp, gpus, plan.rollout_tp, hosts))
        print()
    print(format_plan(plan))
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
