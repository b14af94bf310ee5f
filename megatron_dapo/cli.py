"""`megatron-dapo` command line: one entry point, thin subcommands.

    megatron-dapo config show FILE [key=value ...]      print the resolved config
    megatron-dapo config validate FILE [key=value ...]  check it, exit 2 if wrong
    megatron-dapo train FILE [key=value ...]            the DAPO run (see megatron_dapo/train.py)
    megatron-dapo convert hf-to-mcore|mcore-to-hf ...    checkpoint conversion (tools/convert_*.py)
    megatron-dapo plan FILE --nodes N ...               per-GPU memory and step-time plan (tools/plan.py)
    megatron-dapo eval CHECKPOINT --data FILE [--n 32]  avg@k, pass@k, lengths of any checkpoint (evaluate.py)

User mistakes (UserError) print one line to stderr and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from megatron_dapo.errors import EXIT_USER_ERROR, CliParser, UserError, quiet_optional_backend_warnings


def _config_show(args: argparse.Namespace) -> int:
    from megatron_dapo.config.loader import load_config, to_yaml

    cfg = load_config(args.file, args.overrides)
    sys.stdout.write(to_yaml(cfg))
    return 0


def _config_validate(args: argparse.Namespace) -> int:
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.config.preflight import check_inputs
    from megatron_dapo.lifetime import reaping_descendants

    cfg = load_config(args.file, args.overrides)
    if args.world_size is not None:
        cfg.check_world_size(args.world_size, "--world-size")
    # The reward function and the custom tools are imported here (or in workers started here):
    # what their modules start at import, a new session included, ends with the check.
    with reaping_descendants():
        check_inputs(cfg, world_size=args.world_size)
    if args.world_size is not None:
        dp = cfg.check_world_size(args.world_size, "--world-size")
        print(f"{args.file}: OK (data-parallel size {dp} at world size {args.world_size})")
    else:
        print(f"{args.file}: OK")
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


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="megatron-dapo", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)

    cfg = sub.add_parser("config", help="show or validate an experiment config")
    cfg_sub = cfg.add_subparsers(dest="action", required=True, parser_class=CliParser)
    show = cfg_sub.add_parser("show", help="print the resolved config as YAML")
    show.add_argument("file", help="experiment YAML, e.g. examples/tiny_cpu.yaml")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.clip_ratio_high=0.28")
    show.set_defaults(func=_config_show)
    val = cfg_sub.add_parser("validate", help="check a config; exit 2 with one line if it is wrong")
    val.add_argument("file")
    val.add_argument("overrides", nargs="*")
    val.add_argument("--world-size", type=_positive_int, default=None,
                     help="also check the layout against N processes")
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
