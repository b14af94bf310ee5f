"""Which Python runs SGLang's server, and whether it can, asked before any work starts.

SGLang's CPU form pins its own transformers, so on a CPU machine it lives in a virtual
environment of its own (``make install-sglang-cpu``); GPU images import it in this Python.
:func:`sglang_python` is the one rule of which interpreter; :func:`check_interpreter` runs it
once (a child process, bounded in time) and turns what can be known before a run into one
line: not a program, not a Python, no sglang, or a kernel this CPU cannot execute (SIGILL).
`config validate`, `train` and `eval` reach it through rollout/factory.check_installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from megatron_dapo.errors import UserError
from megatron_dapo.rollout.server_process import describe_exit, package_installed

__all__ = ["INSTALL_HINT", "check_interpreter", "default_cpu_venv", "sglang_python"]

INSTALL_HINT = ("install SGLang: `make install-sglang-cpu` on a CPU machine (its own environment), "
                "`pip install -e .[gpu]` on a GPU machine, or point rollout.sglang.python at an interpreter "
                "that has sglang")

PROBE_TIMEOUT_S = 180.0
"""How long the probe may take: it imports torch and the kernel package, seconds on a warm cache."""

# Run by the interpreter under test: sglang's version without importing it (a second or more),
# then the kernel package the server imports first on a CPU, which is where a kernel built for
# other instructions dies (SIGILL, the process killed before Python can say anything).
_PROBE = """
import importlib.metadata, importlib.util, json, sys
out = {"python": list(sys.version_info[:2]), "sglang": None, "kernel": None, "standin": False}
try:
    out["sglang"] = importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    print(json.dumps(out)); sys.exit(0)
if importlib.util.find_spec("sgl_kernel") is not None:
    import sgl_kernel
    out["kernel"] = getattr(sgl_kernel, "__file__", None) or "?"
    out["standin"] = bool(getattr(sgl_kernel, "MEGATRON_DAPO_STANDIN", False))
print(json.dumps(out))
"""


def default_cpu_venv() -> Path:
    """Where `make install-sglang-cpu` puts SGLang's CPU environment: $MEGATRON_DAPO_SGLANG_VENV, else
    ~/.cache/megatron-dapo/venvs/sglang-cpu (scripts/install_sglang_cpu.sh uses the same rule)."""
    return Path(os.environ.get("MEGATRON_DAPO_SGLANG_VENV") or Path.home() / ".cache/megatron-dapo/venvs/sglang-cpu")


def sglang_python(explicit: str | None = None) -> str | None:
    """The interpreter that runs SGLang's server, or None when none is installed.

    Args:
        explicit: rollout.sglang.python; used as given (it must exist).

    Returns:
        `explicit`; else this Python when it imports sglang (GPU machines, the [gpu] extra);
        else the CPU environment of `make install-sglang-cpu` (default_cpu_venv) when it exists.
    """
    if explicit:
        return explicit if Path(explicit).exists() else None
    if package_installed("sglang"):
        return sys.executable
    python = default_cpu_venv() / "bin" / "python"
    return str(python) if python.exists() else None


def check_interpreter(python: str, where: str) -> None:
    """Raise a one-line UserError unless `python` is a program that runs as Python, has sglang, and
    can import its kernel package on this CPU.

    Args:
        python: the interpreter (sglang_python's answer).
        where: how the user named it, for the message ("rollout.sglang.python=/x", "the SGLang venv /y").
    """
    if python == sys.executable:
        return  # this process imports sglang already (find_spec said so): nothing to learn
    path = Path(python)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError as e:
        raise UserError(f"{where}: {e.strerror}; {INSTALL_HINT}") from None
    problem = _probe(str(path), stamp)
    if problem:
        raise UserError(f"{where}: {problem}")


@lru_cache(maxsize=8)
def _probe(python: str, stamp: int) -> str:
    """What is wrong with `python` as SGLang's interpreter ("" = nothing); cached per file version."""
    del stamp  # part of the cache key only
    if Path(python).is_dir():
        return f"{python} is a directory, not an interpreter; point it at a Python (.../bin/python)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["SGLANG_USE_CPU_ENGINE"] = os.environ.get("SGLANG_USE_CPU_ENGINE", "1")
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, errors="replace",
                              timeout=PROBE_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"{python} did not answer within {PROBE_TIMEOUT_S:.0f}s when asked for its sglang version"
    except OSError as e:
        return f"{python} cannot be run ({e.strerror}); point it at a Python that has sglang"
    if done.returncode < 0:
        return (f"{python} {describe_exit(done.returncode)} while importing SGLang's CPU kernels (sgl_kernel): a "
                "build for another CPU; run `make install-sglang-cpu` without SGLANG_CPU_KERNEL_WHEEL, which "
                "installs the stand-in that runs on every x86-64 CPU (docs/DESIGN.md, \"SGLang's CPU kernels\")")
    info = _last_json(done.stdout)
    if done.returncode != 0 or info is None:
        said = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return (f"{python} did not run as a Python ({describe_exit(done.returncode)}: {said}); "
                "point it at a Python that has sglang")
    if tuple(info.get("python") or ()) < (3, 10):
        return f"{python} is Python {'.'.join(map(str, info.get('python') or ()))}; sglang needs >= 3.10"
    if not info.get("sglang"):
        return f"{python} is a Python without sglang; {INSTALL_HINT}"
    return ""


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
    return None
