"""The CLI's front door (issue 60): --version, an example under every --help, and `doctor`."""

from __future__ import annotations

import argparse

import pytest

import megatron_dapo
from megatron_dapo import cli
from megatron_dapo.plan.report import build_parser as plan_parser


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.run(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"megatron-dapo {megatron_dapo.__version__}\n"


def _parsers(parser: argparse.ArgumentParser, name: str = "megatron-dapo") -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child, sub in action.choices.items():
                out += _parsers(sub, f"{name} {child}")
    return out


def test_every_help_shows_an_example_that_runs_that_command() -> None:
    parsers = [*_parsers(cli.build_parser()), ("megatron-dapo plan", plan_parser())]
    names = [name for name, _ in parsers]
    assert {"megatron-dapo config validate", "megatron-dapo convert mcore-to-hf", "megatron-dapo doctor",
            "megatron-dapo eval", "megatron-dapo train", "megatron-dapo plan"} <= set(names)
    for name, parser in parsers:
        text = parser.format_help()
        assert "\nexample" in text, name
        examples = text[text.index("\nexample") + 1:].splitlines()[1:]
        # plan's own parser is reached as "megatron-dapo plan" too; the top level's show several commands.
        command = name if name != "megatron-dapo" else "megatron-dapo "
        assert examples and all(line.strip().startswith(("megatron-dapo", "torchrun")) for line in examples), name
        assert any(line.strip().startswith(command) for line in examples), name


def test_doctor_names_what_a_bug_report_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    starts = [line.split(" ")[0].rstrip(":") for line in lines]
    for part in ("megatron-dapo", "python", "torch", "megatron-core", "transformer-engine", "sglang", "vllm", "cpu",
                 "nccl"):
        assert part in starts, (part, lines)
    te = next(line for line in lines if line.startswith("transformer-engine"))
    # Its import status comes with the reason (not installed, or why it cannot run here).
    assert "not installed (" in te or ": usable" in te or "not usable: " in te
    cpu = next(line for line in lines if line.startswith("cpu: "))
    assert "logical cores; instruction sets: " in cpu
    assert any(line.startswith(("gpus: ", "gpu 0: ")) for line in lines)
