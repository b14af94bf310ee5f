"""The tool set of a run, from its `tools` section: the built-in tools and the episode runner."""

from __future__ import annotations

import functools

from megatron_dapo.config.tools import ToolsConfig
from megatron_dapo.data.tokenizer import Tokenizer
from megatron_dapo.tools.calculator import run_calculator
from megatron_dapo.tools.episode import EpisodeRunner, EpisodeSettings, Tool
from megatron_dapo.tools.formats import FORMATS
from megatron_dapo.tools.sandbox import SandboxLimits, run_python

__all__ = ["episode_runner", "tool_set"]


def tool_set(cfg: ToolsConfig) -> dict[str, Tool]:
    """Name -> tool for every tool the config lists."""
    p = cfg.python
    limits = SandboxLimits(timeout_s=p.timeout_s, cpu_seconds=p.cpu_seconds, memory_bytes=p.memory_mb * 2**20,
                           file_bytes=p.file_mb * 2**20, processes=p.processes, max_output_bytes=p.max_output_bytes)
    builtins: dict[str, Tool] = {"calculator": run_calculator, "python": functools.partial(run_python, limits=limits)}
    return {name: builtins[name] for name in cfg.tools}


def episode_runner(cfg: ToolsConfig, tokenizer: Tokenizer, max_response_tokens: int) -> EpisodeRunner | None:
    """The runner of the config's episodes; None when tools are off (one turn per response)."""
    if not cfg.enable:
        return None
    settings = EpisodeSettings(fmt=FORMATS[cfg.format], tools=tool_set(cfg), max_turns=cfg.max_turns,
                               max_tool_output_tokens=cfg.max_tool_output_tokens,
                               max_response_tokens=max_response_tokens, calls_in_flight=cfg.calls_in_flight,
                               max_failure_fraction=cfg.max_failure_fraction)
    return EpisodeRunner(settings, tokenizer)
