"""The inside of one sandboxed tool call: ``python -I jail.py <spec json>`` (stdlib only).

tools/sandbox.py starts it in a session of its own, with stdin /dev/null, stdout/stderr one
pipe, a report pipe and no other descriptor, a fixed minimal environment, and kills the
session at the deadline. Three processes, and what each guards:

- J0, the jail (the trainer's child): dies with the trainer (PR_SET_PDEATHSIG, SIGKILL; a
  trainer already gone is noticed), reads the program from the file the trainer wrote (never
  argv: a 240 KB program or a NUL byte would not start), and, with ``isolation=namespaces``,
  unshares user, PID, network, IPC, mount and UTS namespaces at once. The user namespace maps
  one uid: the trainer's own (an ordinary user: the only uid it may map) or nobody (65534,
  when the trainer is root: host root is never mapped, so nothing in the jail is host root).
  Root where user namespaces are refused (a container's seccomp) unshares the rest and
  becomes nobody on the host.
- J1, PID 1 of the new PID namespace: builds a new root on a tmpfs holding only read-only
  binds of /usr, /lib*, /bin, /sbin, a few /etc files (ld.so.cache, localtime, ...), the
  interpreter's prefixes at their own paths (a venv under /tmp or under root's 0700 home
  included: its parents are the tmpfs's 0755 directories), a /dev of null, zero, full,
  random and urandom, a fresh /proc of the new PID namespace (none of the host's: no other
  process's environ or cmdline), and one bounded scratch tmpfs (``scratch_bytes``) seen at
  /tmp, /var/tmp, /dev/shm and /run/lock, the only writable place. pivot_root then detaches
  the host's tree: the repository, the run directory, the cache, $HOME and checkpoints are
  not in the jail at all, readable or writable. Nested user namespaces are set to 0
  (user.max_user_namespaces inside), so the code cannot gain capabilities back. J1 then
  drops to the sandbox uid with no capabilities, is not dumpable (no ptrace of it), forks
  J2 and reaps until J2 exits; then J1 exits and the kernel kills every process left in the
  namespace, however it detached (setsid, double fork). SysV IPC lives in the IPC namespace
  and POSIX shm in the scratch tmpfs: both end with the call. J1 dies with J0 (PDEATHSIG,
  and a pipe checked after it is set), so kill -9 of the trainer takes the whole call down.
- J2, the code: a session of its own (so killing "its" process group cannot reach the jail
  outside the namespace), resource limits (setrlimit, inherited by all it starts: CPU
  seconds, address space, file size, open files, no core dumps, and RLIMIT_NPROC, which in a
  user namespace counts only the processes of this call), no capabilities and no_new_privs,
  the empty working directory /tmp/work with HOME there, then ``execve(python -I main.py)``
  with a fixed environment. Its parent is J1, never the trainer.

With ``isolation=limits_only`` (the machine allows no namespaces and the user accepted it)
only J0 and J2 run: J2 keeps J0's process group (the deadline's kill reaches it), has the
limits, and becomes nobody when the trainer is root and nobody can read the interpreter.

What held is written as JSON to the report pipe by J2 just before the exec (closed then), or
an error that stops the call ("failed": it never runs the code without what was asked).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
AT_RECURSIVE = 0x8000
SYS_MOUNT_SETATTR, SYS_PIVOT_ROOT = 442, {"x86_64": 155, "aarch64": 41}.get(os.uname().machine, 155)
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}.get(os.uname().machine, 126)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
NOBODY = 65534
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib64", "lib32", "libx32")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "alternatives")
DEV_NODES = ("null", "zero", "full", "random", "urandom")
SCRATCH = {"tmp": "tmp", "var/tmp": "var_tmp", "dev/shm": "shm", "run/lock": "lock"}
WORKDIR = "/tmp/work"
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": "/tmp"}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class JailError(Exception):
    """A step the call needs failed: the call is not run."""


def _ok(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise JailError(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _ok(_libc.mount(None if source is None else source.encode(), target.encode(),
                    None if fstype is None else fstype.encode(), ctypes.c_ulong(flags),
                    None if data is None else data.encode()), f"mount {target}")


def _prctl(option: int, arg: int) -> int:
    return _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)


def _die_with_parent() -> None:
    _ok(_prctl(PR_SET_PDEATHSIG, signal.SIGKILL), "prctl(PR_SET_PDEATHSIG)")


def _bind_ro(source: str, target: str) -> None:
    """Bind source at target read-only (its submounts too), nosuid, nodev."""
    _mount(source, target, None, MS_BIND | MS_REC)

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
    if _libc.syscall(SYS_MOUNT_SETATTR, -100, target.encode(), AT_RECURSIVE, ctypes.byref(attr),
                     ctypes.sizeof(attr)) == 0:
        return
    # Before Linux 5.12: remount the top mount, keeping the flags the kernel locks (statvfs's).
    keep = os.statvfs(target).f_flag & (os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME | os.ST_RELATIME)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)


def _drop_capabilities() -> None:
    """No capability left, none to regain (bounding set emptied, no_new_privs)."""
    for cap in range(64):
        _prctl(PR_CAPBSET_DROP, cap)  # EINVAL past the last capability; EPERM without CAP_SETPCAP
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _ok(_libc.syscall(SYS_CAPSET, header, data), "capset")
    _ok(_prctl(PR_SET_NO_NEW_PRIVS, 1), "prctl(PR_SET_NO_NEW_PRIVS)")


def _become(uid: int, gid: int) -> None:
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    _drop_capabilities()


def _namespaced(spec: dict, report: int, code: bytes) -> int:
    """J0 with isolation=namespaces: fork C, map its user namespace, wait for it; C's exit code.

    The uid map is written from here, outside the new user namespace: root may map nobody only
    from the parent namespace (an ordinary user maps its own uid from either).
    """
    uid, gid = os.getuid(), os.getgid()
    root = uid == 0
    if root:
        os.setgroups([])  # root's supplementary groups would stay the code's otherwise
    to_c_r, to_c_w = os.pipe()
    to_j0_r, to_j0_w = os.pipe()
    j0 = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(to_c_w)
        os.close(to_j0_r)
        try:
            _die_with_parent()
            userns = _libc.unshare(CLONE_NEWUSER) == 0
            err = ctypes.get_errno()
            os.write(to_j0_w, b"u" if userns else b"-")
            if os.read(to_c_r, 1) != b"m":
                raise JailError("the jail died while mapping the user namespace")
            if userns:
                inner = (NOBODY, NOBODY) if root else (uid, gid)
                who = "uid nobody" if root else f"uid {uid} (the trainer's, mapped alone)"
                held = [f"user namespace ({who})"]
            elif root:
                inner, held = (NOBODY, NOBODY), ["uid nobody (no user namespace)"]
            else:
                raise JailError(f"unshare(user namespace): {os.strerror(err)}")
            _ok(_libc.unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWNS | CLONE_NEWUTS),
                "unshare(pid, net, ipc, mount, uts namespaces)")
            # The interpreter's directories, opened with this (the trainer's) uid: under root's
            # 0700 home they are out of nobody's reach, and the capabilities of a user
            # namespace do not cover files of unmapped owners. Bound later from these.
            bind_fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in spec["binds"]]
            if root and userns:
                # Files the jail creates need a uid of the namespace; its capabilities stay.
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
                _die_with_parent()  # a uid change clears it
                if os.getppid() != j0:
                    raise JailError("the jail died while it was being set up")
            life_r, life_w = os.pipe()
            j1 = os.fork()
            if j1 == 0:
                os.close(life_w)
                os._exit(_init(spec, *inner, held, report, life_r, code, bind_fds))
            # The init's host pid: the deadline's kill ends the call by killing it (and waits
            # until the kernel has killed the whole namespace).
            _report(report, init_pid=j1)
            os.close(report)
            os.close(life_r)
            return _wait(j1)
        except (JailError, OSError) as e:
            _report_error(report, e)
            os._exit(126)
    os.close(to_c_r)
    os.close(to_j0_w)
    if os.read(to_j0_r, 1) == b"u":
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(f"{NOBODY} {NOBODY} 1\n" if root else f"{uid} {uid} 1\n")
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(f"{NOBODY} {NOBODY} 1\n" if root else f"{gid} {gid} 1\n")
    with contextlib.suppress(BrokenPipeError):  # C is gone; it reported why
        os.write(to_c_w, b"m")
    os.close(report)
    return _wait(pid)


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _report(report: int, **fields: object) -> None:
    """One JSON line to the report pipe (several processes write; tools/sandbox.py merges them)."""
    with contextlib.suppress(OSError):
        os.write(report, (json.dumps(fields) + "\n").encode())


def _report_error(report: int, err: BaseException) -> None:
    _report(report, error=str(err))


def _build_root(spec: dict, uid: int, gid: int, code: bytes, bind_fds: list[int]) -> list[str]:
    """J1: the jail's filesystem (module docstring), then pivot_root into it; what held."""
    held = []
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # A base tmpfs over /tmp becomes the root for a while, the host's tree under /oldroot
    # (its /tmp as it was: a prefix there can still be bound).
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    os.chdir("/tmp")
    for d in ("newroot", "oldroot", "scratch"):
        os.mkdir(d, 0o755)
    _ok(_libc.syscall(SYS_PIVOT_ROOT, b".", b"oldroot"), "pivot_root")
    os.chdir("/")
    _mount("tmpfs", "/newroot", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    size = max(int(spec["scratch_bytes"]), 1 << 20)
    _mount("tmpfs", "/scratch", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes=16384,mode=0755")
    new = "/newroot"
    for d in SYSTEM_DIRS:
        host = f"/oldroot/{d}"
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{new}/{d}")
        elif os.path.isdir(host):
            os.mkdir(f"{new}/{d}", 0o755)
            _bind_ro(host, f"{new}/{d}")
    os.makedirs(f"{new}/etc", 0o755)
    for name in ETC_FILES:
        host = f"/oldroot/etc/{name}"
        if os.path.isdir(host):
            os.mkdir(f"{new}/etc/{name}", 0o755)
        elif os.path.isfile(host):
            open(f"{new}/etc/{name}", "wb").close()
        else:
            continue
        _bind_ro(host, f"{new}/etc/{name}")
    with open(f"{new}/etc/passwd", "w") as f:
        f.write(f"sandbox:x:{uid}:{gid}:sandbox:{WORKDIR}:/usr/sbin/nologin\n")
    with open(f"{new}/etc/group", "w") as f:
        f.write(f"sandbox:x:{gid}:\n")
    os.mkdir(f"{new}/dev", 0o755)
    for name in DEV_NODES:
        open(f"{new}/dev/{name}", "wb").close()
        _mount(f"/oldroot/dev/{name}", f"{new}/dev/{name}", None, MS_BIND)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{new}/dev/{name}")
    os.symlink("/proc/self/fd", f"{new}/dev/fd")
    for target, name in SCRATCH.items():  # one tmpfs, one size bound, seen at four places
        os.mkdir(f"/scratch/{name}", 0o1777)
        os.chmod(f"/scratch/{name}", 0o1777)
        os.makedirs(f"{new}/{target}", 0o755, exist_ok=True)
        _mount(f"/scratch/{name}", f"{new}/{target}", None, MS_BIND)
    held.append("private " + ",".join("/" + t for t in SCRATCH) + f" ({size >> 20} MB tmpfs, the only writable place)")
    for prefix, fd in zip(spec["binds"], bind_fds, strict=True):  # after the scratch: one under /tmp lands on it
        os.makedirs(new + prefix, 0o755, exist_ok=True)
        _bind_ro(f"/oldroot/proc/self/fd/{fd}", new + prefix)
        os.close(fd)
    os.mkdir(f"{new}/proc", 0o555)
    try:
        _mount("proc", f"{new}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        held.append("own /proc")
        try:  # no nested user namespace: the code cannot get capabilities back
            with open(f"{new}/proc/sys/user/max_user_namespaces", "w") as f:
                f.write("0")
            held.append("no nested namespaces")
        except OSError:
            pass
    except JailError:
        held.append("no /proc")  # a container that hides parts of its /proc forbids a new one
    os.makedirs(f"{new}{WORKDIR}", 0o755)
    with open(f"{new}{WORKDIR}/main.py", "wb") as f:
        f.write(code)
    os.chown(f"{new}{WORKDIR}", uid, gid)
    _ok(_libc.sethostname(b"sandbox", 7), "sethostname")
    _ok(_libc.umount2(b"/oldroot", MNT_DETACH), "umount the host's tree")
    _mount(None, new, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    os.chdir(new)
    _ok(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _ok(_libc.umount2(b".", MNT_DETACH), "umount the base")
    os.chdir("/")
    held.append("read-only system, no host files")
    return held


def _limit(spec: dict) -> None:
    cpu = int(spec["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (spec["memory_bytes"], spec["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["file_bytes"], spec["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec["open_files"], spec["open_files"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["processes"], spec["processes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _run_code(spec: dict, workdir: str, held: list[str], report: int, check: tuple[int, int] | None) -> None:
    """J2: limits, the report, then exec the program (never returns)."""
    python = spec["python"]
    if check is not None:
        _become(*check)
    for path in (python, *spec["readable"]):
        if not os.access(path, os.R_OK):
            raise JailError(f"the sandbox user (uid {os.getuid()}) cannot read {path}")
    _limit(spec)
    os.chdir(workdir)
    _die_with_parent()
    _report(report, isolation=", ".join(held))
    os.close(report)
    os.closerange(3, 1 << 16)
    os.execve(python, [python, "-I", "main.py"], {**ENV, "HOME": workdir})


def _init(spec: dict, uid: int, gid: int, held: list[str], report: int, life: int, code: bytes,
          bind_fds: list[int]) -> int:
    """J1: the filesystem, then fork the code and reap until it exits (its exit ends the namespace)."""
    _die_with_parent()
    os.set_blocking(life, False)
    try:
        if os.read(life, 1) == b"":  # J0 died before PDEATHSIG was set: nobody waits for us
            return 137
    except BlockingIOError:
        pass
    os.close(life)
    held += _build_root(spec, uid, gid, code, bind_fds)
    held.insert(0, "no network, pid, ipc, mount and uts namespaces")
    _become(uid, gid)
    _prctl(PR_SET_DUMPABLE, 0)
    _die_with_parent()  # cleared by the uid change
    pid = os.fork()
    if pid == 0:
        os.setsid()
        _run_code(spec, WORKDIR, held, report, None)
    os.close(report)
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 137
        if done == pid:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main() -> int:
    spec = json.loads(sys.argv[1])
    report = int(spec["report_fd"])
    os.umask(0o022)  # the program and the jail's directories readable by the sandbox user
    try:
        _die_with_parent()
        if os.getppid() != spec["parent"]:  # the trainer died before PDEATHSIG was set
            return 137
        with open(spec["code_path"], "rb") as f:
            code = f.read()
        if spec["isolation"] != "limits_only":
            return _namespaced(spec, report, code)
        held = ["limits_only"]
        drop = (NOBODY, NOBODY) if os.geteuid() == 0 and spec["drop_uid"] else None
        if drop:
            os.setgroups([])
            held.append("uid nobody")
        pid = os.fork()
        if pid == 0:
            try:
                _run_code(spec, spec["workdir"], held, report, drop)
            except (JailError, OSError) as err:
                _report_error(report, err)
                os._exit(126)
        os.close(report)
        return _wait(pid)
    except (JailError, OSError) as err:
        _report_error(report, err)
        return 126


if __name__ == "__main__":
    sys.exit(main())
