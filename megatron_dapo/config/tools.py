"""The `tools` section: multi-turn episodes in which the policy calls tools (tools/, issue 40)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from megatron_dapo.config.fields import _check, show

BUILTIN_TOOLS = ("calculator", "python")
"""calculator: exact arithmetic in-process (tools/calculator.py); python: the policy's program in
the sandbox (tools/sandbox.py)."""

MAX_CUSTOM_WORKERS = 256
"""Worker processes of the custom tools: each is an interpreter on the trainer's node, so far
more than its cores is a mistake (100,000 of them would fork until the node gives out)."""

_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_NAME = re.compile(r"[A-Za-z_][\w.-]*")


def tool_entry(entry: str) -> tuple[str, str]:
    """(the name calls use, what runs it) of one `tools.tools` entry.

    A built-in is its own name twice; "package.module:function" is named by its function;
    "name=package.module:function" by the given name. The entry's form is checked by ToolsConfig.
    """
    if ":" not in entry:
        return entry, entry
    name, sep, spec = entry.partition("=")
    if not sep:
        name, spec = entry.rpartition(":")[2], entry
    return name.strip(), spec.strip()


@dataclass(kw_only=True, slots=True)
class PythonToolConfig:
    """Bounds of one call of the python tool (tools/sandbox.py and tools/jail.py say what each guards)."""

    timeout_s: float = 5.0
    """Wall-clock deadline; the call's whole session is killed then (at most 3600)."""
    cpu_seconds: int = 5
    """CPU seconds of the code and everything it starts (at most 3600)."""
    memory_mb: int = 512
    """Address space per process (64 to 1048576)."""
    file_mb: int = 16
    """Largest file it may write (at most 65536)."""
    processes: int = 16
    """Processes of the call (at most 4096)."""
    max_output_bytes: int = 65536
    """Output kept; more ends the call and is cut in the middle (at most 2**30)."""
    isolation: str = "namespaces"
    """namespaces: user, PID, network, IPC, mount and UTS namespaces, a read-only system and a
    private scratch (the kernel must allow unprivileged user namespaces, or the trainer be root);
    checked at config time, a machine that cannot refuses the run in one line. limits_only:
    resource limits alone, for machines without namespaces: the policy's code can then signal
    the trainer's processes, reach its ports and read what the trainer's user can read (every
    call's record says limits_only)."""

    def __post_init__(self) -> None:
        from megatron_dapo.tools.sandbox import ISOLATIONS

        for name, top in (("timeout_s", 3600), ("cpu_seconds", 3600), ("memory_mb", 2**20), ("file_mb", 2**16),
                          ("processes", 4096), ("max_output_bytes", 2**30)):
            value = getattr(self, name)
            _check(value > 0, name, "must be > 0")
            _check(value <= top, name, f"is {value:g}, past the bound {top} (a limit past it is no limit, and the "
                   "kernel refuses some); lower it")
        _check(self.memory_mb >= 64, "memory_mb", "must be >= 64 (the interpreter alone needs ~50 MB)")
        _check(self.isolation in ISOLATIONS, "isolation", f"must be one of {list(ISOLATIONS)}")


@dataclass(kw_only=True, slots=True)
class ToolsConfig:
    """Tool calls inside a response (verl's multi_turn names where it has one)."""

    enable: bool = False
    """Responses are episodes: the policy may stop on a call, the tool answers, it continues."""
    format: str = "tags"
    """Call format (tools/formats.py): tags (<calc>...</calc>, the embedded task's tokenizer) or
    hermes (<tool_call>{json}</tool_call>, Qwen's chat templates)."""
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    """Tools the policy may call: the built-ins calculator and python, and custom tools
    "package.module:function" (tools/custom.py): f(argument: str) -> str, the answer the policy
    sees, run in worker processes. A custom tool's name in calls is its function's name, or
    the name written before it ("search=pkg.web:lookup"); names must differ. The tags format
    calls only "calculator", so a custom tool there takes that name ("calculator=pkg.mod:f")."""
    max_turns: int = 4
    """Policy turns per episode (verl: max_assistant_turns); a call at the last turn is not answered."""
    max_tool_output_tokens: int = 64
    """Tokens of one answer, markers included; longer answers are cut in the middle."""
    result_width: int = 0
    """Right-pad every tool answer with "_" to this many characters (0 = as the tool wrote it). A
    small policy copies a result into its answer by the distance back to it, which a fixed width
    makes the same for every result (tools/formats.pad_result). The embedded task's warm start shows
    its results padded the same way."""
    calls_in_flight: int = 8
    """Tool calls run at once."""
    max_failure_fraction: float = 0.5
    """Stop the run (one line, exit 2) once more than this share of a step's calls failed to run
    (the tool crashed or could not start; a custom tool raised, timed out or lost its worker;
    counted from 16 calls on). Errors the python tool's code raises are answers, not failures."""
    custom_workers: int = 2
    """Worker processes of the custom tools, each running one call at a time (all custom tools
    share them)."""
    custom_timeout_s: float = 10.0
    """Seconds one custom tool call may take; its worker is then killed and replaced, and the
    call fails with an error text the policy sees."""
    python: PythonToolConfig = field(default_factory=PythonToolConfig)
    """The python tool's sandbox."""

    def __post_init__(self) -> None:
        from megatron_dapo.tools.formats import FORMATS

        _check(self.format in FORMATS, "format", f"must be one of {sorted(FORMATS)}")
        _check(self.result_width >= 0, "result_width", "must be >= 0 (0 = answers as the tool wrote them)")
        # Messages quote the user's values bounded (show) and are built only on failure: 99,000
        # aliases of one 600 KB entry are 59 GB as a plain repr.
        unknown = [t for t in self.tools if not isinstance(t, str) or (":" not in t and t not in BUILTIN_TOOLS)]
        if unknown:
            _check(False, "tools", f"has {show(unknown)}; expected built-in tools {list(BUILTIN_TOOLS)} or custom "
                   "tools 'package.module:function' (or 'name=package.module:function')")
        names: dict[str, str] = {}
        for entry in self.tools:
            name, spec = tool_entry(entry)
            if not (spec in BUILTIN_TOOLS or _SPEC.fullmatch(spec)):
                _check(False, "tools", f"has {show(entry)}: a custom tool is 'package.module:function' (or "
                       "'name=package.module:function') with Python names")
            if not _NAME.fullmatch(name):
                _check(False, "tools", f"has {show(entry)}: the tool name {show(name)} must be a letter or _ then "
                       "letters, digits, _ . or -")
            if name in names:
                _check(False, "tools", f"has two tools named {show(name)} ({show(names[name])} and {show(entry)}); "
                       "name one of them with 'name=package.module:function'")
            names[name] = entry
        _check(not self.enable or bool(self.tools), "tools", "is empty while tools.enable=true")
        if self.enable and self.format == "tags":
            _check("calculator" in names, "tools", f"has no tool named 'calculator' ({show(sorted(names))}), and every "
                   "call of tools.format=tags names it (<calc>...</calc>): add calculator, name a custom tool "
                   "'calculator=package.module:function', or use tools.format=hermes (its calls name their tool)")
        _check(self.max_turns >= 1, "max_turns", "must be >= 1")
        _check(self.max_tool_output_tokens >= 4, "max_tool_output_tokens", "must be >= 4 (the markers alone take 2)")
        _check(self.calls_in_flight >= 1, "calls_in_flight", "must be >= 1")
        _check(0 < self.max_failure_fraction <= 1, "max_failure_fraction", "must be in (0, 1] (1.0 = never stop)")
        _check(self.custom_workers >= 1, "custom_workers", "must be >= 1")
        _check(self.custom_workers <= MAX_CUSTOM_WORKERS, "custom_workers", f"must be <= {MAX_CUSTOM_WORKERS} (worker "
               "processes on the trainer's node; far more than its cores only waits)")
        _check(self.custom_timeout_s > 0, "custom_timeout_s", "must be > 0")

    def custom_tools(self) -> dict[str, str]:
        """Name -> "package.module:function" of the custom tools listed."""
        return {name: spec for name, spec in map(tool_entry, self.tools) if spec not in BUILTIN_TOOLS}
