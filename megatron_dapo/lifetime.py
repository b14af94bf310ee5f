"""Helper processes die with the trainer process that started them, even after kill -9.

A trainer killed with SIGKILL (the OOM killer, `kill -9`, a node agent) runs no cleanup:
`daemon=True`, atexit and `finally` do nothing. Its helpers were re-parented to PID 1
and lived on: megatron-core's checkpoint writer starts a multiprocessing "spawn"
Manager (~270 MB) on the first save, the reward pool starts workers, and both keep the
multiprocessing resource tracker alive. They also hold the trainer's stdout, so
`megatron-dapo train ... | tee log` never returned.

Linux's PR_SET_PDEATHSIG makes the kernel send a signal to a process when its parent
dies. It must be set by the child itself (it is cleared in a forked child), so:

- every "spawn" child of a megatron-dapo process re-imports the parent's main module,
  which imports this package; `megatron_dapo/__init__.py` calls `die_with_parent()`
  there when the interpreter was started by multiprocessing (`--multiprocessing-fork`).
  That covers megatron-core's Manager and spawn-started reward workers;
- reward and custom tool workers (rewards/workers.py) call it first thing (their parent is
  the forkserver, which itself exits when the trainer's end of its pipe closes);
- the resource tracker exits by itself once every process holding its pipe is gone.

Two more cases, for processes that leave their group on purpose (``setsid()``, as a daemonising
library does at import):

- a rank under torchrun sets PR_SET_PDEATHSIG itself (:func:`die_with_launcher`), so a kill -9 of
  the torchrun agent ends it at once (both ranks were alive 15 s later, holding the node);
- code of a user's module that may start processes (a reward function or a custom tool, imported
  by `config validate` or by a reward/tool worker) runs in a *subreaper*
  (PR_SET_CHILD_SUBREAPER): an orphan of its children is re-parented to it, not to PID 1, so
  :func:`kill_descendants` finds every process it started, a new session or not, and kills them
  (:func:`reaping_descendants` around `config validate`; WorkerSet before it stops a worker).

Inference servers (SGLang, vLLM) are started with subprocess in a session of their own, so
that stopping one takes its process group; PDEATHSIG does not fit them (it fires when the
launching *thread* exits, and their children are not ours to change). Each gets a
:class:`GroupReaper` instead (rollout/server_process.py): a small process in a session of
its own that holds the read end of a pipe whose write end only the trainer has. The kernel
closes that end however the trainer dies, kill -9 included; on EOF the reaper sends SIGTERM
to the server's process group and SIGKILL after a grace. A server stopped by the trainer
releases its reaper once its group is gone (a trainer that dies mid-stop still takes it), and
the reaper also leaves by itself within a second of the group's end, so a later process group
with the same id is not touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_CHILD_SUBREAPER = 36


def started_by_multiprocessing() -> bool:
    """True in an interpreter that multiprocessing's spawn start method launched."""
    return "--multiprocessing-fork" in getattr(sys, "orig_argv", ())


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent process exits.

    Returns:
        True if it is set; False off Linux or when prctl is unavailable.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:
        # The parent died between our start and the prctl: no signal will come.
        os.kill(os.getpid(), sig)
    return True


def die_with_launcher() -> bool:
    """Under torchrun, die with its agent (this rank's parent), however the agent dies.

    Returns:
        True if set; False outside torchrun (a rank of plain `python` or of srun keeps its
        parent's lifetime: a shell that exits must not end the run).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    return die_with_parent(signal.SIGKILL)


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper(on: bool = True) -> bool:
    """Make this process the one its descendants' orphans are re-parented to (or stop being it)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, int(on))


def descendants(pid: int | None = None) -> list[int]:
    """Every live (not zombie) process below ``pid`` (default: this one), from /proc."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def kill_descendants(pid: int | None = None, *, spare: frozenset[int] = frozenset()) -> list[int]:
    """SIGKILL every process below ``pid`` but ``spare``, again until none is left (a process may
    fork while it is being killed). They are not reaped here: a child's owner (subprocess,
    multiprocessing) waits for it, and an adopted orphan stays a zombie until this process ends.

    Returns:
        The processes killed.
    """
    killed: list[int] = []
    for _ in range(50):
        found = [p for p in descendants(pid) if p not in spare]
        if not found:
            break
        for p in found:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        killed += found
        time.sleep(0.01)
    return killed


def _multiprocessing_helpers() -> frozenset[int]:
    """The forkserver and the resource tracker of this process: started once, reused by every
    later pool (a killed forkserver would break them), and gone when the process ends."""
    pids = set()
    with contextlib.suppress(ImportError, AttributeError):
        from multiprocessing import forkserver, resource_tracker

        pids.add(forkserver._forkserver._forkserver_pid)  # type: ignore[attr-defined]
        pids.add(resource_tracker._resource_tracker._pid)  # type: ignore[attr-defined]
    return frozenset(p for p in pids if p)


@contextlib.contextmanager
def reaping_descendants() -> Iterator[None]:
    """Inside: this process is a subreaper. On the way out, every process started inside (a
    child of a module imported there, in a session of its own or not) is killed; those that
    were running before are spared."""
    was = frozenset(descendants())
    became = become_subreaper()
    try:
        yield
    finally:
        kill_descendants(spare=was | _multiprocessing_helpers())
        if became:
            become_subreaper(False)


# Run by the reaper (`python -S -c`), argv: the process group, the grace in seconds. Its stdin is
# the pipe: b"q" = released, EOF = the trainer is gone. It also leaves once the group is gone.
_REAPER = r"""
import os, select, signal, sys, time
pgid, grace = int(sys.argv[1]), float(sys.argv[2])
def alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
while True:
    ready = select.select([0], [], [], 1.0)[0]
    if not alive():
        sys.exit(0)
    if ready:
        data = os.read(0, 1)
        if data == b"q":
            sys.exit(0)
        if not data:
            break
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        sys.exit(0)
    deadline = time.monotonic() + grace
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not alive():
        sys.exit(0)
"""

REAPER_GRACE_S = 4.0
"""SIGTERM to SIGKILL: SGLang 0.5.18 ends all its processes about 5 s after a SIGTERM, but a
server whose trainer is gone has nothing to save; the group is gone well inside 10 s."""


class GroupReaper:
    """Kills process group `pgid` when this process dies, however it dies, unless released first."""

    def __init__(self, pgid: int, *, grace_s: float = REAPER_GRACE_S):
        read, write = os.pipe()  # both ends non-inheritable: no exec'd child of ours holds `write`
        try:
            self._process: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-S", "-c", _REAPER, str(pgid), str(grace_s)], stdin=read,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        self._write: int | None = write
        # Every request thread of an engine whose server died calls check_alive -> release at
        # once; the pipe's fd number must be closed exactly once (a second close is EBADF, or
        # worse, closes whatever object reused the number in between).
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The reaper's process id (None once released)."""
        return self._process.pid if self._process is not None else None

    def release(self) -> None:
        """The group ended (or is being ended) under our control: the reaper leaves without a signal."""
        with self._lock:
            write, self._write = self._write, None
            if write is None:
                return
            with contextlib.suppress(OSError):
                os.write(write, b"q")
            os.close(write)
            if self._process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._process.wait(timeout=5.0)
                self._process = None
