"""The tool set of a run, from its `tools` section: the built-in and custom tools, and the episode runner."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

from megatron_dapo.config.tools import ToolsConfig, tool_entry
from megatron_dapo.data.tokenizer import Tokenizer
from megatron_dapo.tools.calculator import run_calculator
from megatron_dapo.tools.custom import TOOL_LOG, CustomToolPool
from megatron_dapo.tools.episode import EpisodeRunner, EpisodeSettings, Tool
from megatron_dapo.tools.formats import FORMATS
from megatron_dapo.tools.sandbox import SandboxLimits, run_python

__all__ = ["episode_runner", "tool_set"]


def tool_set(cfg: ToolsConfig, *, log_dir: str | os.PathLike[str] | None = None,
             ) -> tuple[dict[str, Tool], list[Callable[[], None]]]:
    """Name -> tool for every tool the config lists, and what to call once they are no longer used.

    Custom tools start their worker processes here (tools/custom.py); the closers stop them.

    Args:
        log_dir: where the custom tools' prints go (TOOL_LOG in it); None = the console.

    Raises:
        UserError: a custom tool does not load in its workers (one line).
    """
    p = cfg.python
    limits = SandboxLimits(timeout_s=p.timeout_s, cpu_seconds=p.cpu_seconds, memory_bytes=p.memory_mb * 2**20,
                           file_bytes=p.file_mb * 2**20, processes=p.processes, max_output_bytes=p.max_output_bytes,
                           isolation=p.isolation)
    builtins: dict[str, Tool] = {"calculator": run_calculator, "python": functools.partial(run_python, limits=limits)}
    custom = cfg.custom_tools()
    pool = None
    if custom:
        pool = CustomToolPool(custom, cfg.custom_workers, cfg.custom_timeout_s,
                              log_path=None if log_dir is None else Path(log_dir) / TOOL_LOG)
    tools = {name: builtins[spec] if spec in builtins else pool.tool(name)  # type: ignore[union-attr]
             for name, spec in map(tool_entry, cfg.tools)}
    return tools, [] if pool is None else [pool.close]


def episode_runner(cfg: ToolsConfig, tokenizer: Tokenizer, max_response_tokens: int, *,
                   log_dir: str | os.PathLike[str] | None = None) -> EpisodeRunner | None:
    """The runner of the config's episodes; None when tools are off (one turn per response).

    Args:
        log_dir: the run's output directory, for what custom tools print; None = the console.
    """
    if not cfg.enable:
        return None
    tools, closers = tool_set(cfg, log_dir=log_dir)
    try:
        settings = EpisodeSettings(fmt=FORMATS[cfg.format], tools=tools, max_turns=cfg.max_turns,
                                   max_tool_output_tokens=cfg.max_tool_output_tokens, result_width=cfg.result_width,
                                   max_response_tokens=max_response_tokens, calls_in_flight=cfg.calls_in_flight,
                                   max_failure_fraction=cfg.max_failure_fraction)
        return EpisodeRunner(settings, tokenizer, closers=closers)
    except BaseException:
        for close in closers:
            close()
        raise
