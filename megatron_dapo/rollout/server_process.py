"""What every inference-server engine (SGLang, vLLM) needs from the launching rank.

- ``server_environment``: the server's environment, scrubbed of the launcher's variables.
  A trainer rank started by torchrun carries ``TORCHELASTIC_USE_AGENT_STORE=True`` (and
  RANK, WORLD_SIZE, MASTER_ADDR, ...). A server that inherits them and then builds its own
  process group with ``init_process_group("tcp://host:port", ...)`` gets a client-only
  TCPStore that waits for a master which never comes: the server hangs at start
  (torch's rendezvous honours the agent-store flag for tcp:// too). So the server sees
  none of them; it is not a member of the trainer's job.
- ``node_address``: the address other nodes reach this one at. ``gethostbyname(gethostname())``
  is 127.0.1.1 in many containers and Debian hosts, so the address is that of the interface
  whose route reaches MASTER_ADDR (a UDP ``connect`` sends no packet), unless overridden.
- ``ServerProcess``: a server subprocess with its log file, death detection and clean stop.
- ``call_while_healthy``: a long request (generate) that gives up when the server stops
  answering health checks, instead of holding every rank until the request's timeout.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_dapo.lifetime import GroupReaper
from megatron_dapo.rollout.engine import EngineError

__all__ = [
    "HOST_ENV",
    "LAUNCHER_VARIABLES",
    "ServerProcess",
    "call_while_healthy",
    "node_address",
    "package_installed",
    "poll_until_healthy",
    "server_environment",
]

_LOG_TAIL_LINES = 40
PORT_ATTEMPTS = 3
"""Launches of one server whose port another process took between free_port and the bind."""

KILLED_EXIT_S = 60.0
"""How long ServerProcess.stop waits for a SIGKILLed server to be gone (its teardown, not a choice of its)."""

HOST_ENV = "MEGATRON_DAPO_ENGINE_HOST"
"""Environment override of the address engines bind to and advertise (rollout.host wins)."""

LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_DEVICE_MAX_CONNECTIONS", "SLURM_LABELIO",
)  # fmt: skip
"""Variables a torchrun/srun trainer rank has that a server must not inherit. Besides the
rendezvous ones: CUDA_DEVICE_MAX_CONNECTIONS=1 is Megatron's setting for its own
communication/compute overlap and serialises an inference server's kernels. SLURM_LABELIO (the
trainer's `srun --label`) would make the srun step of a server on a node of its own
(rollout/fleet/nodes.py) prefix every line of its log with "0: "."""

_LAUNCHER_PREFIXES = ("TORCHELASTIC_",)

SRUN_REQUEST_VARIABLES = (
    "SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_GPU", "SLURM_GPUS", "SLURM_GPUS_PER_NODE",
    "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_SOCKET", "SLURM_CPUS_PER_GPU", "SLURM_GRES", "SLURM_STEP_GRES",
    "SLURM_TRES_PER_TASK", "SLURM_CPUS_PER_TASK", "SRUN_CPUS_PER_TASK", "SLURM_NTASKS_PER_NODE",
    "SLURM_NTASKS_PER_GPU", "SLURM_NTASKS_PER_TRES", "SLURM_OVERLAP", "SLURM_EXCLUSIVE", "SLURM_GPU_BIND",
    "SLURM_TRES_BIND", "SLURM_HINT",
)  # fmt: skip
"""The job's and the trainer step's requests that srun reads as its own options (its input
environment, SLURM 22.05-24.05: e.g. SLURM_MEM_PER_NODE as --mem, SLURM_GPUS_PER_NODE as
--gpus-per-node): a server's srun step on a node of the fleet's own (rollout/fleet/nodes.py)
inheriting them would ask for the job's whole node and block the next server's step. No server
reads them."""


def server_environment(extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of an inference server launched from a trainer rank.

    Args:
        extra: variables to set on top (the engine's own settings win over the base).
        base: the environment to start from; None = this process's.

    Returns:
        A new dict without the launcher's variables (LAUNCHER_VARIABLES, TORCHELASTIC_*) and the
        requests srun would read from it (SRUN_REQUEST_VARIABLES).
    """
    env = dict(os.environ if base is None else base)
    for key in list(env):
        if key in LAUNCHER_VARIABLES or key in SRUN_REQUEST_VARIABLES or key.startswith(_LAUNCHER_PREFIXES):
            del env[key]
    env.update(extra or {})
    return env


def node_address(master_addr: str | None = None) -> str:
    """This node's address as processes on other nodes reach it.

    Args:
        master_addr: the job's rendezvous host; None = $MASTER_ADDR.

    Returns:
        $MEGATRON_DAPO_ENGINE_HOST when set; else the local address of the interface whose
        route reaches master_addr (loopback when master_addr is this machine or unset and
        the hostname does not resolve to a routable address).
    """
    override = os.environ.get(HOST_ENV, "").strip()
    if override:
        return override
    target = master_addr if master_addr is not None else os.environ.get("MASTER_ADDR", "")
    if target:
        try:
            family = socket.AF_INET6 if ":" in target else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect((target, 9))  # UDP connect: picks the route, sends nothing
                return str(sock.getsockname()[0])
        except OSError:
            pass
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
    # 127.0.1.1 (Debian's /etc/hosts entry for the hostname) is loopback: only this node.
    return address if not ipaddress.ip_address(address).is_loopback else "127.0.0.1"


def package_installed(name: str) -> bool:
    """Whether `name` imports as a real package here: find_spec alone also finds a namespace package,
    which any directory of that name in the working directory is (a run's output dir `sglang/`,
    a clone of the engine's repository), and the server then died on "No module named ...".
    """
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


def lost_port_race(log_path: str | Path, offset: int = 0) -> bool:
    """Whether a server that just died says, in its log after ``offset``, that its port was taken
    (free when free_port picked it, bound by another process before the server bound it)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read(4 << 20).decode(errors="replace")
    except OSError:
        return False
    # Python's OSError says "Address already in use", uvicorn's bind error "address already in use"
    # ("[Errno 98] error while attempting to bind on address ...: address already in use", seen in
    # an SGLang 0.5.18 server's log), zmq "Address already in use (addr=...)".
    return "address already in use" in text.lower() or "EADDRINUSE" in text


_SIGNAL_CAUSES = {
    signal.SIGILL: "its native code uses an instruction this CPU lacks; "
                   "`grep -o 'avx[0-9a-z_]*' /proc/cpuinfo | sort -u` lists what this CPU has",
    signal.SIGKILL: "from outside: the kernel's out-of-memory killer (see `dmesg`), a scheduler or a user",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGBUS: "a crash in native code, or shared memory (/dev/shm) that ran out",
}


def describe_exit(code: int) -> str:
    """How a process ended, for one line: "exited with code 3", or "was killed by SIGILL (illegal
    instruction: ...)" for a negative Popen return code."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"was killed by signal {-code}"
    cause = _SIGNAL_CAUSES.get(sig)
    description = signal.strsignal(sig) or sig.name
    return f"was killed by {sig.name} ({description.lower()}{': ' + cause if cause else ''})"


class ServerProcess:
    """A server subprocess whose output goes to a log file; knows how to report its death."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        name: str,
        log_path: str | Path,
        env: dict[str, str] | None = None,
        kind: str = "SGLang",
        shm_prefixes: tuple[str, ...] = (),
        private_files: tuple[str | Path, ...] = (),
    ):
        """Start the process (in its own session, so stop() takes its children too).

        Args:
            command: argv.
            name: engine name for messages.
            log_path: file receiving stdout and stderr (created, parents too).
            env: full environment; None inherits ours.
            kind: the server's name in messages ("SGLang", "vLLM").
            shm_prefixes: names of /dev/shm files the server makes and leaves behind when it
                ends (SGLang 0.5.18: "sglang_loads_", its load snapshot, and multiprocessing's
                "sem.mp-" semaphores, after SIGTERM as after kill -9); those its process tree
                holds are noted (note_shared_memory) and removed once it has exited.
            private_files: files made for this server alone (its key's file): removed once it has exited.
        """
        self.name = name
        self.kind = kind
        self._shm_prefixes = shm_prefixes
        self._shm_files: set[str] = set()
        self._shm_lock = threading.Lock()  # request threads that find the server dead clean up at once
        self._private_files = tuple(Path(p) for p in private_files)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        """Where this life's output starts in the log (a relaunch appends to its predecessor's)."""
        # Owner-only: servers print their settings, SGLang its API key among them (server_args=...).
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        with open(fd, "ab") as log:
            self._popen = subprocess.Popen(
                list(command), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        # The server's session is its own (stop() takes its children), so nothing ties it to this
        # process: the reaper ends its group when this process dies, kill -9 included (lifetime.py).
        try:
            self._reaper = GroupReaper(self._popen.pid)
        except BaseException:
            self._popen.kill()
            self._popen.wait()
            raise

    @property
    def pid(self) -> int:
        """Process id of the server."""
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """Exit code, or None while the process runs."""
        return self._popen.poll()

    def lost_port_race(self) -> bool:
        """Whether the process has ended saying, in this life's log, that its port was taken."""
        return self.returncode is not None and lost_port_race(self.log_path, self.log_offset)

    def log_tail(self, num_lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines of the log file ("" when it is empty or unreadable)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def note_shared_memory(self) -> None:
        """Note the /dev/shm files (of shm_prefixes) the server's process tree holds now."""
        if not self._shm_prefixes or self._popen.poll() is not None:
            return
        import psutil

        try:
            root = psutil.Process(self._popen.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                paths = [f.path for f in proc.open_files()] + [m.path for m in proc.memory_maps(grouped=True)]
            except psutil.Error:
                continue
            with self._shm_lock:
                self._shm_files.update(p for p in paths if p.startswith("/dev/shm/")
                                       and Path(p).name.startswith(self._shm_prefixes))

    @property
    def shared_memory_files(self) -> frozenset[str]:
        """The /dev/shm files noted as the server's (removed once it has exited)."""
        return frozenset(self._shm_files)

    def _remove_shared_memory(self) -> None:
        """Unlink the noted /dev/shm files and the private files; only once the process has exited."""
        if self._popen.poll() is None:
            return
        with self._shm_lock:
            for path in [*sorted(self._shm_files), *self._private_files]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self._shm_files.clear()

    def wait_for_exit(self, timeout_s: float) -> int | None:
        """Wait up to timeout_s for the process to end; its exit code, or None while it runs."""
        try:
            return self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def check_alive(self) -> None:
        """Raise EngineError naming the engine, its exit code and log when the process ended."""
        code = self._popen.poll()
        if code is not None:
            self._reaper.release()
            self._remove_shared_memory()
            raise EngineError(
                f"{self.kind} engine {self.name} (pid {self._popen.pid}) {describe_exit(code)}; "
                f"log {self.log_path}, last lines:\n{self.log_tail()}"
            )

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL it after timeout_s; then remove its /dev/shm leftovers.

        The reaper is released only once the group is gone: a trainer that dies while it waits
        here (torchrun's SIGTERM when another rank failed, seen 2026-11-29 with an SGLang server
        that outlived its SIGTERM) still takes the server with it.
        """
        if self._popen.poll() is None:
            self.note_shared_memory()
            try:
                os.killpg(self._popen.pid, 15)
                self._popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._popen.pid, 9)
                # SIGKILL is not refused; only the kernel's teardown of a large process takes time.
                # Waited for the grace alone, a loaded CPU's teardown outlasted it (seen 2026-12-04,
                # a fleet's SGLang servers under six runs on two cores): the wait raised out of stop
                # and the key files and /dev/shm leftovers stayed behind.
                killed_wait_s = max(timeout_s, KILLED_EXIT_S)
                try:
                    self._popen.wait(timeout=killed_wait_s)
                except subprocess.TimeoutExpired:  # the reaper and the files stay: it is not gone
                    raise EngineError(f"{self.kind} server {self.name} (pid {self._popen.pid}) did not exit within "
                                      f"{killed_wait_s:g} s of its SIGKILL; log {self.log_path}") from None
            except ProcessLookupError:
                pass
            # The leader's exit does not end its group: a child it left is ended here, not orphaned.
            # Only in the call that saw the leader alive, right after its exit: a later call (a
            # second stop, a leader reaped long ago) could meet the id reused by another group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, 9)
        self._reaper.release()
        self._remove_shared_memory()


def poll_until_healthy(health: Callable[[float], bool], *, timeout_s: float, poll_s: float, what: str,
                       process: ServerProcess | None, stop: threading.Event | None = None) -> None:
    """Call `health(timeout)` until it returns True; raise EngineError after timeout_s.

    Args:
        health: one health check (it raises EngineError itself when the process died).
        timeout_s: how long to keep trying.
        poll_s: pause between checks.
        what: the engine in the message, e.g. "SGLang engine sglang0 at http://...".
        process: the server process whose log tail the message shows, if owned.
        stop: set by the engine's shutdown while a restart relaunches its server: the wait ends
            (EngineError) at the next check instead of after timeout_s (the run is ending).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            raise EngineError(f"{what} was shut down while it started")
        if health(min(30.0, max(deadline - time.monotonic(), 1.0))):
            if process is not None:
                process.note_shared_memory()
            return
        time.sleep(poll_s)
    tail = "" if process is None else f"; log {process.log_path}, last lines:\n{process.log_tail()}"
    raise EngineError(f"{what} not healthy after {timeout_s:.0f}s{tail}")


def call_while_healthy(call: Callable[[], Any], *, health: Callable[[float], bool], interval_s: float,
                       max_failures: int, what: str, probe: str, log_hint: str = "",
                       on_wait: Callable[[], None] | None = None) -> Any:
    """Run a long request while checking that its server still works; return its answer.

    A server that dies closes its sockets and the request fails at once. One that stops
    answering (SGLang's scheduler killed or wedged behind a live HTTP front end, its node
    gone from the network) would hold the request until its timeout (an hour for a
    generate), and with it every rank of the job waiting for the controller. So `health`
    is asked every `interval_s` meanwhile (SGLang's /health_generate answers at once while
    tokens are being produced, and 503 after 20 s when they are not), and after
    `max_failures` failed checks in a row the request is abandoned. It stays behind in a
    daemon thread, which cannot keep the process from exiting.

    Args:
        call: the request; runs in its own thread.
        health: one health check with a timeout in seconds (True = healthy); it may raise
            EngineError itself (an owned server process that exited).
        interval_s: seconds between checks, also each check's timeout.
        max_failures: failed checks in a row that abandon the request.
        what: the request in the message, e.g. "SGLang engine sglang1: /generate".
        probe: the health endpoint in the message.
        log_hint: appended to the message (where the server's log is).
        on_wait: called every 0.1 s while the request runs (e.g. to abort it by id).

    Raises:
        EngineError: the request's own error, or the server stopped answering.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["answer"] = call()
        except BaseException as err:
            outcome["error"] = err

    thread = threading.Thread(target=run, name=f"request {what}", daemon=True)
    start = time.monotonic()
    thread.start()
    failures = 0
    next_check = start + interval_s
    while True:
        thread.join(min(interval_s, 0.1) if on_wait is not None else interval_s)
        if not thread.is_alive():
            break
        if on_wait is not None:
            on_wait()
            if time.monotonic() < next_check:
                continue
        next_check = time.monotonic() + interval_s
        failures = 0 if health(interval_s) else failures + 1
        if failures >= max_failures and thread.is_alive():
            raise EngineError(f"{what} abandoned after {time.monotonic() - start:.0f}s: {probe} failed {failures} "
                              f"times in a row meanwhile (the server died, hangs or cannot be reached){log_hint}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["answer"]
