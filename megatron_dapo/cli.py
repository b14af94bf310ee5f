"""`megatron-dapo` command line: one entry point, thin subcommands.

    megatron-dapo config show FILE [key=value ...]      print the resolved config (--doc: with each key's notes)
    megatron-dapo config explain KEY                    one key's type, default and meaning
    megatron-dapo config validate FILE [key=value ...]  check it, exit 2 if wrong
    megatron-dapo train FILE [key=value ...]            the DAPO run (see megatron_dapo/train.py)
    megatron-dapo convert hf-to-mcore|mcore-to-hf ...    checkpoint conversion (tools/convert_*.py)
    megatron-dapo plan FILE --nodes N ...               per-GPU memory and step-time plan (tools/plan.py)
    megatron-dapo eval CHECKPOINT --data FILE [--n 32]  avg@k, pass@k, lengths of any checkpoint (evaluate.py)
    megatron-dapo doctor                                 what a bug report needs about this machine
    megatron-dapo --version

User mistakes (UserError) print one line to stderr and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from megatron_dapo.errors import EXIT_USER_ERROR, CliParser, UserError, quiet_optional_backend_warnings


def _config_show(args: argparse.Namespace) -> int:
    from megatron_dapo.config.loader import load_config, to_yaml

    cfg = load_config(args.file, args.overrides)
    if args.doc:
        from megatron_dapo.config.reference import annotated_yaml

        sys.stdout.write(annotated_yaml(cfg))
    else:
        sys.stdout.write(to_yaml(cfg))
    return 0


def _config_explain(args: argparse.Namespace) -> int:
    from megatron_dapo.config.reference import explain

    for key in args.keys:
        sys.stdout.write(explain(key))
    return 0


def _config_validate(args: argparse.Namespace) -> int:
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.config.preflight import check_inputs
    from megatron_dapo.lifetime import reaping_descendants

    cfg = load_config(args.file, args.overrides)
    world_size, source = args.world_size, "--world-size"
    t = cfg.trainer
    if world_size is None and args.static and t.n_gpus_per_node is not None:
        # A recipe that names its launch shape is checked at it (the sbatch scripts pass --world-size).
        world_size, source = t.nnodes * t.n_gpus_per_node, "trainer.nnodes x trainer.n_gpus_per_node"
    if world_size is not None:
        cfg.check_world_size(world_size, source)
    # The reward function and the custom tools are imported here (or in workers started here):
    # what their modules start at import, a new session included, ends with the check.
    with reaping_descendants():
        warnings = check_inputs(cfg, world_size=world_size, world_source=source, static=args.static)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    mode = f" (--static: {len(warnings)} warning(s))" if args.static else ""
    if world_size is not None:
        dp = cfg.check_world_size(world_size, source)
        print(f"{args.file}: OK{mode} (data-parallel size {dp} at world size {world_size})")
    else:
        print(f"{args.file}: OK{mode}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of processes, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (the number of processes), got {value}")
    return value


def _train(args: argparse.Namespace) -> int:
    from megatron_dapo.train import main as train_main

    return train_main([args.file, *args.overrides])


def _plan(args: argparse.Namespace) -> int:
    from megatron_dapo.plan import run as plan_run

    return plan_run(args.args)


def _eval(args: argparse.Namespace) -> int:
    from megatron_dapo.evaluate import run_eval

    return run_eval(args)


# Instruction sets that decide which CPU kernels run (vLLM's and SGLang's CPU builds, torch's bf16).
CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _cpu_line() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        import platform

        return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores (no /proc/cpuinfo)"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set()
    for line in info.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    have = [f for f in CPU_FLAGS if f in flags]
    return f"cpu: {model}, {os.cpu_count()} logical cores; instruction sets: {' '.join(have) or 'none of ' + '/'.join(CPU_FLAGS)}"


def doctor_report() -> list[str]:
    """What a bug report needs about this machine, one line each; probes, never fails."""
    import platform

    import megatron_dapo

    lines = [f"megatron-dapo {megatron_dapo.__version__} ({Path(megatron_dapo.__file__).parent})",
             f"python {platform.python_version()} ({sys.executable}) on {platform.platform()}"]
    import torch

    cuda = torch.version.cuda or "none (CPU build)"
    lines.append(f"torch {torch.__version__} (CUDA build: {cuda}; cuda available: {torch.cuda.is_available()})")
    for dist in ("megatron-core", "transformers", "tensorboard", "mlflow-skinny", "mlflow", "wandb"):
        lines.append(f"{dist}: {_version(dist) or 'not installed'}")
    import importlib.util

    from megatron_dapo.models.transformer_impl import te_status

    te = _version("transformer-engine") or _version("transformer_engine")
    if importlib.util.find_spec("transformer_engine") is None:
        lines.append("transformer-engine: not installed (model.transformer_impl=auto uses megatron-core's local layers)")
    else:
        usable, why = te_status()
        lines.append(f"transformer-engine {te or '?'}: {'usable' if usable else 'not usable: ' + why}")
    from megatron_dapo.rollout.factory import check_installed

    for engine, dist in (("sglang", "sglang"), ("vllm", "vllm")):
        try:
            check_installed(engine)
            lines.append(f"{engine} {_version(dist) or '(own environment)'}: usable")
        except UserError as e:
            lines.append(f"{engine}: not usable: {e}")
    lines.append(_cpu_line())
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            lines.append(f"gpu {i}: {prop.name}, {prop.total_memory / 2**30:.0f} GiB, compute capability "
                         f"{prop.major}.{prop.minor}")
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        lines.append(f"nccl: {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl or 'not in this torch build'}")
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        lines.append("gpus: none visible" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""))
        lines.append(f"nccl: {'not used (no GPU)' if torch.version.cuda else 'not in this torch build (CPU)'}; "
                     "gloo carries the collectives")
    settings = sorted(k for k in os.environ if k.startswith(("NCCL_", "TORCH_NCCL_", "MEGATRON_DAPO_")))
    lines.append("environment: " + (" ".join(f"{k}={os.environ[k]}" for k in settings) or "no NCCL_*/MEGATRON_DAPO_* set"))
    return lines


def _doctor(args: argparse.Namespace) -> int:
    print("\n".join(doctor_report()))
    return 0


EXAMPLES: dict[str, list[str]] = {
    "": ["megatron-dapo train examples/tiny_cpu.yaml trainer.output_dir=runs/my_first",
         "megatron-dapo config validate --static examples/dapo_qwen2.5_32b.yaml --world-size 128",
         "megatron-dapo doctor                 # versions, CPU, GPUs, NCCL: paste into a bug report"],
    "config": ["megatron-dapo config show examples/tiny_cpu.yaml algorithm.clip_ratio_high=0.3"],
    "config show": ["megatron-dapo config show examples/dapo_qwen2.5_32b.yaml algorithm.clip_ratio_high=0.3"],
    "config explain": ["megatron-dapo config explain algorithm.clip_ratio_high",
                       "megatron-dapo config explain algorithm.filter_groups"],
    "config validate": ["megatron-dapo config validate examples/tiny_cpu.yaml trainer.total_training_steps=50",
                        "megatron-dapo config validate --static examples/dapo_qwen2.5_32b.yaml --world-size 128"],
    "train": ["megatron-dapo train examples/tiny_cpu.yaml trainer.output_dir=runs/lr2e-4 optim.lr=2e-4",
              "torchrun --standalone --nproc-per-node 2 -m megatron_dapo.train examples/tiny_cpu.yaml "
              "parallel.tensor_model_parallel_size=2"],
    "convert": ["megatron-dapo convert hf-to-mcore --hf /ckpt/Qwen2.5-7B --out /ckpt/q7-mcore --tp 2"],
    "convert hf-to-mcore": ["megatron-dapo convert hf-to-mcore --hf /ckpt/Qwen2.5-7B --out /ckpt/q7-mcore --tp 2"],
    "convert mcore-to-hf": ["megatron-dapo convert mcore-to-hf --ckpt runs/x/checkpoints/step_100 --out /ckpt/q7-dapo"],
    "eval": ["megatron-dapo eval runs/tiny_cpu/checkpoints/latest --data <val.jsonl> --n 8"],
    "doctor": ["megatron-dapo doctor > doctor.txt"],
    "plan": ["megatron-dapo plan examples/dapo_qwen2.5_32b.yaml --nodes 16 --gpus-per-node 8 --gpu-mem-gib 80"],
}
"""One or two commands per (sub)command, shown under its --help (`plan --help` is plan/report.py's)."""


def _add_examples(parser: argparse.ArgumentParser, name: str = "") -> None:
    """Give `parser` and its subcommands their EXAMPLES as an epilog (kept as written)."""
    if name in EXAMPLES and parser.epilog is None:
        parser.epilog = "example" + ("s" if len(EXAMPLES[name]) > 1 else "") + ":\n" + \
            "\n".join(f"  {line}" for line in EXAMPLES[name])
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child, sub in action.choices.items():
                _add_examples(sub, f"{name} {child}".strip())


def build_parser() -> argparse.ArgumentParser:
    import megatron_dapo

    parser = CliParser(prog="megatron-dapo", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"megatron-dapo {megatron_dapo.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)

    cfg = sub.add_parser("config", help="show, explain or validate an experiment config")
    cfg_sub = cfg.add_subparsers(dest="action", required=True, parser_class=CliParser)
    show = cfg_sub.add_parser("show", help="print the resolved config as YAML")
    show.add_argument("file", help="experiment YAML, e.g. examples/tiny_cpu.yaml")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.clip_ratio_high=0.28")
    show.add_argument("--doc", action="store_true",
                      help="above each key, its type, default and meaning (docs/guide/config-reference.md)")
    show.set_defaults(func=_config_show)
    explain = cfg_sub.add_parser("explain", help="print a key's type, default and meaning, "
                                 "e.g. megatron-dapo config explain algorithm.clip_ratio_high")
    explain.add_argument("keys", nargs="+", metavar="KEY", help="dotted config key, e.g. trainer.save_interval")
    explain.set_defaults(func=_config_explain)
    val = cfg_sub.add_parser("validate", help="check a config; exit 2 with one line if it is wrong")
    val.add_argument("file", help="experiment YAML, e.g. examples/tiny_cpu.yaml")
    val.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_training_steps=50")
    val.add_argument("--world-size", type=_positive_int, default=None,
                     help="also check the layout against N processes")
    val.add_argument("--static", action="store_true",
                     help="only the checks that do not need the target node (no device, Transformer Engine or "
                          "engine probe; a path missing here is a warning): for a login node")
    val.set_defaults(func=_config_validate)

    train = sub.add_parser("train", help="run DAPO training (one process per device)")
    train.add_argument("file", help="experiment YAML, e.g. examples/tiny_cpu.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides")
    train.set_defaults(func=_train)

    from megatron_dapo.convert import add_convert_subparser

    add_convert_subparser(sub)
    plan = sub.add_parser("plan", help="per-GPU memory and step time of a config on a cluster", add_help=False)
    plan.add_argument("args", nargs=argparse.REMAINDER, help="see tools/plan.py --help")
    plan.set_defaults(func=_plan)
    from megatron_dapo.evaluate import add_eval_arguments

    ev = sub.add_parser("eval", help="score a checkpoint on a prompt dataset: avg@k, pass@k, lengths, responses JSONL")
    add_eval_arguments(ev)
    ev.set_defaults(func=_eval)
    doctor = sub.add_parser("doctor", help="versions, engines, CPU instruction sets, GPUs and NCCL, for a bug report")
    doctor.set_defaults(func=_doctor)
    _add_examples(parser)
    return parser


def run(argv: list[str] | None, parser: argparse.ArgumentParser | None = None) -> int:
    """Parse and dispatch; returns the exit code."""
    quiet_optional_backend_warnings()
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["convert"]:
        # One process streams the checkpoint on the CPU (a torchrun launch uses its GPUs).
        from megatron_dapo.device import hide_gpus_for_cpu_work

        hide_gpus_for_cpu_work()
    if argv[:1] == ["plan"]:
        # plan has a parser of its own (megatron_dapo/plan/report.py); argparse's REMAINDER would not
        # hand it a leading --help/-h (the top-level parser refused them as unrecognized).
        args = argparse.Namespace(args=list(argv[1:]), func=_plan)
    else:
        parser = parser or build_parser()
        # Options may sit between the file and its overrides (`config validate F --world-size 2 k=v`):
        # argparse leaves overrides after an option unparsed, and parse_intermixed_args refuses subcommands.
        args, extra = parser.parse_known_args(argv)
        if extra:
            if not hasattr(args, "overrides") or any(x.startswith("-") for x in extra):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            args.overrides = [*args.overrides, *extra]
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
