"""The inside of one sandboxed tool call: run as ``python -I jail.py <limits json> <code>`` (stdlib only).

What it does before the policy's code runs, and what each step guards (tools/sandbox.py starts
it in a session of its own, with no inherited descriptors but stdout/stderr, and a scrubbed
environment; it kills the whole session at the deadline):

1. Namespaces, where the process may make them (root, or an unprivileged user namespace):
   a network namespace (only a down loopback: no network), a mount namespace with private
   tmpfs mounts over /tmp, /var/tmp and /dev/shm (the code's scratch space, bounded, gone
   after the call: writes to world-writable places never reach the host), and a PID namespace
   whose first process is the code's interpreter: when it dies, the kernel kills every process
   it left behind, however it detached (setsid, double fork).
2. Resource limits (setrlimit, inherited by everything the code starts): CPU seconds (a busy
   loop dies of SIGXCPU/SIGKILL even if the wall deadline were missed), address space (a 10 GB
   allocation fails with MemoryError), file size (SIGXFSZ / EFBIG past the cap), open files,
   processes (RLIMIT_NPROC: a fork bomb stops at the cap; the kernel does not apply it to root,
   so step 3 matters), no core dumps.
3. Identity: run as nobody (uid/gid 65534) when started as root: the host's files are then
   read-only or unreadable to the code, and RLIMIT_NPROC counts.
4. An empty working directory (on the private /tmp when there is one), HOME there, a minimal
   environment (no inherited secrets), and ``python -I`` (no user site, no PYTHON* variables).

Everything the machine does not allow is skipped; what held is written to the report pipe the
caller passed (its descriptor in the limits), which is closed before the code runs; the
limits of step 2 always apply.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUSER = 0x00020000, 0x40000000, 0x20000000, 0x10000000
MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV = 0x4000, 0x40000, 0x2, 0x4
NOBODY = 65534


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> bool:
    return _libc().unshare(flags) == 0


def _mount_tmpfs(target: str, size_bytes: int) -> bool:
    libc = _libc()
    if not os.path.isdir(target):
        return False
    options = f"size={max(size_bytes, 1 << 20)},mode=1777".encode()
    return libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) == 0


def _isolate(limits: dict) -> tuple[list[str], str]:
    """Namespaces and private scratch mounts; returns (what held, the working directory)."""
    held: list[str] = []
    workdir = limits["workdir"]
    if os.geteuid() != 0:
        return held, workdir
    if _unshare(CLONE_NEWNET):
        held.append("no network")
    if _unshare(CLONE_NEWNS) and _libc().mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0:
        scratch = [t for t in ("/tmp", "/var/tmp", "/dev/shm") if _mount_tmpfs(t, limits["scratch_bytes"])]
        if "/tmp" in scratch:
            held.append("private " + ",".join(scratch))
            workdir = "/tmp/work"
            os.makedirs(workdir, exist_ok=True)
            if limits["drop_uid"]:
                os.chown(workdir, NOBODY, NOBODY)
    if _unshare(CLONE_NEWPID):
        held.append("pid namespace")
    return held, workdir


def _limit(limits: dict) -> None:
    cpu = int(limits["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"], limits["open_files"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"], limits["processes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> int:
    limits, code = json.loads(sys.argv[1]), sys.argv[2]
    held, workdir = _isolate(limits)
    pid = os.fork() if "pid namespace" in held else 0  # the child is PID 1 of the new namespace
    if pid:
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    if os.geteuid() == 0 and limits["drop_uid"]:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        held.append("uid nobody")
    _limit(limits)
    os.chdir(workdir)
    report = int(limits["report_fd"])
    os.write(report, (", ".join(held) or "limits only").encode())
    os.close(report)
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    os.execve(limits["python"], [limits["python"], "-I", "-c", code], env)
    return 127


if __name__ == "__main__":
    sys.exit(main())
