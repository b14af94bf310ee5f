"""Running a policy's Python code where it cannot hurt the trainer: one bounded child per call.

A tool call is the policy's own text, so it is treated as hostile. Each call writes the
program to a file of its own (never argv: no size limit, NUL bytes and lone surrogates reach
Python's compiler as the policy wrote them and come back as its error) and runs
``python -I tools/jail.py`` in a session of its own (``start_new_session``), with only its
stdout/stderr pipe and a report pipe open (``close_fds``), stdin from /dev/null and a fixed
environment (nothing of the trainer's: no VLLM_API_KEY, no tokens). The jail (tools/jail.py,
which says what each step guards) puts the code in user, PID, network, IPC, mount and UTS
namespaces with a read-only system and a private scratch, or, with
``isolation="limits_only"``, under the resource limits alone; it reports what held, which
``ToolResult.isolation`` carries. This side enforces the wall deadline and the output cap:

- wall time: at ``timeout_s`` the whole session gets SIGKILL (a child that ignores SIGTERM
  included; the PID namespace's init dies with it, and with it every process of the call);
- output: stdout and stderr are read together up to ``max_output_bytes``; past that the session
  is killed and the text keeps its head and tail with a marker in the middle;
- bytes that are not UTF-8 are decoded with U+FFFD replacement, never an exception.

Whatever happens (non-zero exit, a signal, a limit), the result is text the policy sees
(``ToolResult.text``) plus a machine-readable ``status``; nothing raises into the trainer. A
jail that cannot set up what was asked runs nothing and answers status "failed" (the episode
runner's breaker counts those); `isolation_problem` is the same check made once, at config
time. This module and jail.py import only the standard library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ISOLATIONS", "Interpreter", "SandboxLimits", "ToolResult", "code_interpreter", "isolation_problem",
           "run_python"]

JAIL = Path(__file__).with_name("jail.py")
ISOLATIONS = ("namespaces", "limits_only")
"""namespaces: the jail's namespaces, read-only system and private scratch (tools/jail.py);
limits_only: resource limits alone, for machines that allow no namespaces (the code can then
signal the trainer's processes and read what its user can)."""
RLIMIT_MAX = 2**62
"""Every resource bound stays below this (setrlimit takes a C long)."""
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
"""Bound read-only into every jail (jail.SYSTEM_DIRS); an interpreter under them needs no bind of its own."""


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
    """Size of the private scratch tmpfs (/tmp, /var/tmp, /dev/shm and /run/lock together)."""
    processes: int = 16
    """RLIMIT_NPROC: processes of the call (in its user namespace; of the sandbox user with limits_only)."""
    open_files: int = 64
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 64 * 1024
    """Output kept (stdout and stderr together); more kills the call and is cut in the middle."""
    isolation: str = "namespaces"
    """One of ISOLATIONS."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_seconds", "memory_bytes", "file_bytes", "scratch_bytes", "processes",
                     "open_files", "max_output_bytes"):
            if not 0 < getattr(self, name) < RLIMIT_MAX:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)} must be > 0 and < 2**62")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"SandboxLimits.isolation={self.isolation!r}: expected one of {ISOLATIONS}")


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
    """How the call was isolated, as the jail reported it (e.g. "pid, net, ipc, mount, uts namespaces,
    user namespace (uid nobody), private /tmp,..., own /proc, ..."; "limits_only" when only the limits held)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(code: str, limits: SandboxLimits | None = None) -> ToolResult:
    """Run ``code`` with ``python -I`` in a fresh sandbox and return its output; never raises for the code's faults.

    Args:
        code: the program text (the policy's call), any str (NUL bytes, lone surrogates, any size).
        limits: the bounds; defaults to SandboxLimits().

    Returns:
        A ToolResult (status says which bound, if any, ended it).
    """
    limits = limits or SandboxLimits()
    start = time.monotonic()
    interpreter = code_interpreter(limits.isolation)
    workdir = tempfile.mkdtemp(prefix="mdapo-tool-")
    code_path = os.path.join(workdir, "main.py")
    with open(code_path, "wb") as f:
        f.write(code.encode("utf-8", "surrogatepass"))  # Python's compiler answers for what is not UTF-8
    if limits.isolation == "limits_only" and interpreter.drop_uid:
        os.chmod(workdir, 0o777)  # the code's working directory, as nobody
        os.chmod(code_path, 0o644)
    report_r, report_w = os.pipe()
    spec = {**dataclasses.asdict(limits), "workdir": workdir, "code_path": code_path, "report_fd": report_w,
            "python": interpreter.python, "binds": list(interpreter.binds), "readable": list(interpreter.readable),
            "drop_uid": interpreter.drop_uid, "parent": os.getpid()}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", str(JAIL), json.dumps(spec)], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            pass_fds=(report_w,), env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd=workdir,
        )
    except OSError as err:
        os.close(report_r)
        os.close(report_w)
        shutil.rmtree(workdir, ignore_errors=True)
        return ToolResult(f"error: the tool could not start: {err}", "failed", time.monotonic() - start)
    os.close(report_w)
    try:
        output, status = _collect(proc, limits, start)
    finally:
        report = _kill_session(proc, report_r)
        shutil.rmtree(workdir, ignore_errors=True)
    if "error" in report:
        return ToolResult(f"error: the sandbox could not be set up ({limits.isolation}): {report['error']}",
                          "failed", time.monotonic() - start)
    isolation = str(report.get("isolation", ""))
    text = output.decode("utf-8", errors="replace")
    if status is None:
        code_ = proc.returncode
        if code_ == 0:
            status = "ok"
        elif code_ < 0 or code_ > 128:
            sig = -code_ if code_ < 0 else code_ - 128
            status = "killed"
            text += f"\n[killed by {signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig}]"
        elif not isolation:  # the jail ended before it ran the code, and said nothing
            return ToolResult(f"error: the sandbox ended with code {code_} before running the code: {text[-300:]}",
                              "failed", time.monotonic() - start)
        else:
            status = "error"
    elif status == "timeout":
        text += f"\n[timed out after {limits.timeout_s:g} s]"
    return ToolResult(text, status, time.monotonic() - start, isolation)


@dataclass(frozen=True, slots=True)
class Interpreter:
    """The Python that runs the code, and what the jail needs to run it."""

    python: str
    """Its path, as the jail execs it (the same path inside the jail)."""
    binds: tuple[str, ...]
    """Directories bound read-only at their own paths into the jail (its prefixes outside the system dirs)."""
    readable: tuple[str, ...]
    """Files the sandbox user must be able to read (the executable, the standard library's os.py)."""
    drop_uid: bool
    """limits_only, as root: the code can run as nobody (every directory on the way world-searchable)."""


@functools.cache
def code_interpreter(isolation: str = "namespaces") -> Interpreter:
    """The Python that runs the code: this process's own, unless root's jail user (nobody) cannot read it.

    With namespaces the interpreter's prefixes are bound at their own paths under directories
    of the jail's (0755), so only the files inside them must be world-readable; with
    limits_only every directory on the host's path must be world-searchable too. As root the
    fallback is the system's /usr/bin/python3 (the code needs nothing of ours); where nobody
    can read either, this process's own is kept and the jail refuses the call in one line
    (isolation_problem at config time).
    """
    root = os.geteuid() == 0
    first = None
    for candidate in dict.fromkeys((sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")):
        found = _describe(candidate)
        if found is None:
            continue
        first = first or found
        if not root:
            return found
        if isolation == "namespaces" and all(_world_readable(p, found.binds) for p in found.readable):
            return found
        if isolation == "limits_only" and all(_world_readable(p, ()) for p in found.readable):
            return dataclasses.replace(found, drop_uid=True)
    assert first is not None, "no Python found, not even this one"
    return first


def _describe(python: str) -> Interpreter | None:
    """python's prefixes and standard library (asked of it unless it is this interpreter)."""
    real = os.path.realpath(python)
    if not os.path.isfile(real):
        return None
    if real == os.path.realpath(sys.executable):
        prefixes, os_py = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix], os.__file__
    else:
        probe = "import json, os, sys; print(json.dumps([[sys.prefix, sys.base_prefix, sys.exec_prefix, " \
                "sys.base_exec_prefix], os.__file__]))"
        try:
            out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, timeout=30,
                                 env={"PATH": "/usr/bin:/bin"}, check=True).stdout
            prefixes, os_py = json.loads(out)
        except (OSError, subprocess.SubprocessError, ValueError):
            return None
    dirs = {os.path.realpath(p) for p in prefixes} | {os.path.dirname(os.path.dirname(real))}
    binds: list[str] = []
    for d in sorted(dirs, key=len):
        if d != "/" and not _under(d, SYSTEM_DIRS) and not _under(d, binds):
            binds.append(d)
    return Interpreter(python, tuple(binds), (real, os.path.realpath(os_py)), False)


def _under(path: str, dirs: tuple[str, ...] | list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _world_readable(path: str, binds: tuple[str, ...]) -> bool:
    """Others may read path and search every directory above it (up to its bind, which the jail's own dirs replace)."""
    try:
        if not os.stat(path).st_mode & 0o004:
            return False
        for d in Path(path).parents:
            if not os.stat(d).st_mode & 0o001:
                return False
            if str(d) in binds:
                return True
        return True
    except OSError:
        return False


@functools.cache
def isolation_problem(isolation: str = "namespaces") -> str | None:
    """Why the sandbox cannot run code here with this isolation, or None: one probe call, once per process."""
    r = run_python("print('ok')", SandboxLimits(isolation=isolation, timeout_s=60, cpu_seconds=30))
    if r.ok and r.text == "ok\n":
        return None
    text = r.text.strip().removeprefix("error: ")
    return text.splitlines()[-1][:300] if text else f"a probe call ended {r.status}"


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


def _kill_session(proc: subprocess.Popen, report_fd: int) -> dict:
    """SIGKILL what is left of the call, reap the jail; the jail's report.

    With namespaces the PID namespace's init is killed too, and this waits until it is gone:
    the kernel kills every process of the namespace first (a setsid'd child included), so
    nothing of the call runs once this returns.
    """
    report = _read_report(report_fd)
    init = _pidfd_of_init(report.get("init_pid"))
    try:
        if init is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(init, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if init is not None:
            select.select([init], [], [], 10.0)  # readable once the init (and its namespace) is gone
    finally:
        if init is not None:
            os.close(init)
    if proc.stdout is not None:
        proc.stdout.close()
    return report


def _pidfd_of_init(pid: object) -> int | None:
    """A pidfd of the jail's PID-namespace init, checked to be one (NSpid ends in 1): never another process."""
    if not isinstance(pid, int) or pid <= 1:
        return None
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
    except OSError:
        nspid = []
    if len(nspid) < 2 or nspid[-1] != "1":
        os.close(fd)
        return None
    return fd


def _read_report(fd: int) -> dict:
    """The jail's report lines merged ({"isolation": ..., "init_pid": ...} or {"error": ...}); {} if none."""
    chunks = []
    try:
        os.set_blocking(fd, False)
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except (BlockingIOError, OSError):
        pass
    finally:
        os.close(fd)
    report: dict = {}
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        try:
            fields = json.loads(line)
        except ValueError:
            continue
        if isinstance(fields, dict):
            report = {**fields, **report}  # the first error counts (later ones follow from it)
    return report
