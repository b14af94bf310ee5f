"""Process facts read from /proc (tests only)."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def cpu_flags() -> set[str]:
    """This CPU's flags from /proc/cpuinfo; MEGATRON_DAPO_CPUINFO names another cpuinfo (the install
    script's rule), for a Python running under an emulated CPU (docs/benchmarks.md: the AVX2 checks)."""
    import os
    from pathlib import Path

    for line in Path(os.environ.get("MEGATRON_DAPO_CPUINFO", "/proc/cpuinfo")).read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()
