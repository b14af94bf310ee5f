"""Running a policy's Python code where it cannot hurt the trainer: one bounded child per call.

A tool call is the policy's own text, so it is treated as hostile. Each call runs
``python -I tools/jail.py`` in a session of its own (``start_new_session``), with only its
stdout/stderr pipe and a report pipe open (``close_fds``), stdin from /dev/null and a scrubbed
environment; the jail (tools/jail.py, which says what each step guards) adds namespaces where
the machine allows them, resource limits, the nobody user and an empty working directory, then
execs the code. This side enforces the wall deadline and the output cap:

- wall time: at ``timeout_s`` the whole session gets SIGKILL (a child that ignores SIGTERM
  included; with the PID namespace every process it started too);
- output: stdout and stderr are read together up to ``max_output_bytes``; past that the session
  is killed and the text keeps its head and tail with a marker in the middle;
- bytes that are not UTF-8 are decoded with U+FFFD replacement, never an exception.

Whatever happens (non-zero exit, a signal, a limit), the result is text the policy sees
(``ToolResult.text``) plus a machine-readable ``status``; nothing raises into the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SandboxLimits", "ToolResult", "code_interpreter", "run_python"]

JAIL = Path(__file__).with_name("jail.py")


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    """The bounds of one call (tools.python section of the config)."""

    timeout_s: float = 5.0
    """Wall-clock deadline of the call; the session is killed then."""
    cpu_seconds: int = 5
    """RLIMIT_CPU of the code and everything it starts."""
    memory_bytes: int = 512 * 2**20
    """RLIMIT_AS: address space of each process (the interpreter needs ~50 MB of it)."""
    file_bytes: int = 16 * 2**20
    """RLIMIT_FSIZE: the largest file the code may write."""
    scratch_bytes: int = 64 * 2**20
    """Size of each private tmpfs (/tmp, /var/tmp, /dev/shm) where namespaces are allowed."""
    processes: int = 16
    """RLIMIT_NPROC of the sandbox user (applies when the code runs as nobody or an ordinary user)."""
    open_files: int = 64
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 64 * 1024
    """Output kept (stdout and stderr together); more kills the call and is cut in the middle."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_seconds", "memory_bytes", "file_bytes", "scratch_bytes", "processes",
                     "open_files", "max_output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)} must be > 0")


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What one call produced."""

    text: str
    """The output the policy sees (stdout and stderr, or the error)."""
    status: str
    """ok | error (non-zero exit) | timeout | output_limit | killed (a signal) | failed (could not start)."""
    seconds: float
    """Wall time of the call."""
    isolation: str = ""
    """What the jail could set up beyond the limits (e.g. "no network, private /tmp, pid namespace, uid nobody")."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(code: str, limits: SandboxLimits | None = None) -> ToolResult:
    """Run ``code`` with ``python -I`` in a fresh sandbox and return its output; never raises for the code's faults.

    Args:
        code: the program text (the policy's call).
        limits: the bounds; defaults to SandboxLimits().

    Returns:
        A ToolResult (status says which bound, if any, ended it).
    """
    limits = limits or SandboxLimits()
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="mdapo-tool-")
    os.chmod(workdir, 0o777)  # the code may run as nobody where no private /tmp replaces it
    report_r, report_w = os.pipe()
    python, drop_uid = code_interpreter()
    spec = {**dataclasses.asdict(limits), "workdir": workdir, "report_fd": report_w, "python": python,
            "drop_uid": drop_uid}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", str(JAIL), json.dumps(spec), code], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            pass_fds=(report_w,), env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd=workdir,
        )
    except OSError as err:
        os.close(report_r)
        os.close(report_w)
        shutil.rmtree(workdir, ignore_errors=True)
        return ToolResult(f"the tool could not start: {err}", "failed", time.monotonic() - start)
    os.close(report_w)
    try:
        output, status = _collect(proc, limits, start)
    finally:
        _kill_session(proc)
        isolation = _read_all(report_r)
        shutil.rmtree(workdir, ignore_errors=True)
    text = output.decode("utf-8", errors="replace")
    if status is None:
        code_ = proc.returncode
        if code_ == 0:
            status = "ok"
        elif code_ < 0 or code_ > 128:
            sig = -code_ if code_ < 0 else code_ - 128
            status = "killed"
            text += f"\n[killed by {signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig}]"
        else:
            status = "error"
    elif status == "timeout":
        text += f"\n[timed out after {limits.timeout_s:g} s]"
    return ToolResult(text, status, time.monotonic() - start, isolation)


@functools.cache
def code_interpreter() -> tuple[str, bool]:
    """The Python that runs the code, and whether it can run as nobody (when this process is root).

    As nobody, the code needs an interpreter and standard library every user may read: this
    process's own when all its directories are world-searchable, else the system's
    /usr/bin/python3 (the code needs nothing of ours). Without one, the code keeps this uid
    (the isolation report says so) rather than not running.
    """
    if os.geteuid() != 0:
        return sys.executable, False
    for candidate in (sys.executable, "/usr/bin/python3"):
        real = Path(os.path.realpath(candidate))
        if real.is_file() and all(os.stat(d).st_mode & 0o001 for d in real.parents) \
                and os.stat(real).st_mode & 0o001 and _stdlib_world_readable(candidate):
            return candidate, True
    return sys.executable, False


def _stdlib_world_readable(python: str) -> bool:
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        stdlib = Path(os.__file__).parent
    else:
        stdlib = Path("/usr/lib") / f"python{sys.version_info.major}.{sys.version_info.minor}"
        found = sorted(Path("/usr/lib").glob("python3.*"))
        stdlib = stdlib if stdlib.is_dir() else (found[-1] if found else stdlib)
    return stdlib.is_dir() and all(os.stat(d).st_mode & 0o001 for d in (stdlib, *stdlib.parents))


def _collect(proc: subprocess.Popen, limits: SandboxLimits, start: float) -> tuple[bytes, str | None]:
    """Read the merged output until exit, the deadline or the cap; the status if a bound ended it."""
    assert proc.stdout is not None
    kept = bytearray()
    total = 0
    tail = b""
    half = limits.max_output_bytes // 2
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    status = None
    try:
        while True:
            left = limits.timeout_s - (time.monotonic() - start)
            if left <= 0:
                status = "timeout"
                break
            if not selector.select(timeout=min(left, 0.5)):
                if proc.poll() is not None and not _readable(proc):
                    break
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            total += len(chunk)
            if len(kept) < half:
                kept += chunk[: half - len(kept)]
            tail = (tail + chunk)[-half:]
            if total > limits.max_output_bytes:
                status = "output_limit"
                break
    finally:
        selector.close()
    if status == "output_limit":
        skipped = total - len(kept) - len(tail)
        return bytes(kept) + f"\n[... {skipped} bytes cut ...]\n".encode() + tail, status
    if total > len(kept):
        kept += tail[len(tail) - (total - len(kept)):]
    return bytes(kept), status


def _readable(proc: subprocess.Popen) -> bool:
    with selectors.DefaultSelector() as s:
        s.register(proc.stdout, selectors.EVENT_READ)
        return bool(s.select(timeout=0))


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the call's whole session (what is left of it), then reap the jail."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _read_all(fd: int) -> str:
    try:
        os.set_blocking(fd, False)
        data = os.read(fd, 4096)
    except (BlockingIOError, OSError):
        data = b""
    finally:
        os.close(fd)
    return data.decode(errors="replace")
