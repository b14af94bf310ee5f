"""A user's function in worker processes, one call per worker at a time, each with a deadline.

The reward pool (rewards/pool.py) and the custom tools (tools/custom.py) both call code the
trainer does not control: it may hang, crash its interpreter, print megabytes, or hang at
import. One such call must cost one call, not the run. A WorkerSet is the part they share:
worker processes that load the function once, run calls, and are killed and replaced when a
call passes its deadline or the worker dies; each call ends as an Outcome (returned, raised,
timed out, worker died). How calls are queued, counted and turned into answers is the owner's.

Why not concurrent.futures.ProcessPoolExecutor: it cannot stop a running task, and a
worker that dies breaks the whole executor. Here each worker is a process with its own
pipe; the owner hands a worker one call at a time, so it always knows which call a worker
is running, kills the worker when that call's deadline passes and starts a fresh one.
Workers start with "forkserver" (or "spawn" where forkserver is missing): a fresh
interpreter, never a fork of a process that holds threads and communicator state.

Workers are daemon processes so that they die with the controller, also after kill -9
(lifetime.py); the function therefore cannot start processes of its own. A WorkerSet is not
thread-safe: one thread owns it (the reward pool's caller, the tool pool's dispatcher).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from megatron_dapo.errors import UserError
from megatron_dapo.lifetime import become_subreaper, die_with_parent, kill_descendants

Loader = Callable[[Any], Callable[..., Any]]
"""Runs in each worker: a spec -> the function; a module-level function (sent by reference), raising
UserError in the user's words when the spec names nothing usable."""


def choose_start_method(start_method: str | None, owner: str) -> str:
    """forkserver where available, else spawn; never fork (torch threads, communicators).

    Raises:
        UserError: an explicit start method that is fork or not available here.
    """
    methods = mp.get_all_start_methods()
    if start_method is None:
        start_method = "forkserver" if "forkserver" in methods else "spawn"
    if start_method not in ("forkserver", "spawn") or start_method not in methods:
        raise UserError(
            f"{owner} start_method={start_method!r}: expected one of "
            f"{[m for m in ('forkserver', 'spawn') if m in methods]} (fork is unsafe beside torch threads)"
        )
    return start_method


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one call ended."""

    task: Any
    """The owner's token of the call, as given to WorkerSet.send."""
    result: Any = None
    """What the function returned (error is None)."""
    error: str | None = None
    """None if it returned; else "<Type>: <message>" (it raised), "timeout after X s" or
    "worker process died (exit code N)"."""
    timed_out: bool = False
    """The call was stopped at its deadline."""


class _Worker:
    """One worker process, its pipe, and the call it is running."""

    __slots__ = ("call_id", "conn", "deadline", "process", "ready", "task")

    def __init__(self, process: Any, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.ready = False  # set when the worker has loaded the function
        self.task: Any = None  # the owner's token of the call it is running
        self.call_id = 0  # echoed by the worker with the answer: a check that answers match calls
        self.deadline = math.inf  # monotonic time: end of start-up, or of the running call


def _worker_main(conn: Connection, load: Loader, spec: Any, log_path: str | None = None,
                 scrub_env: tuple[str, ...] = ()) -> None:
    """Loop of a worker process: load the function, then run calls until told to stop.

    Messages in: (call_id, args), or None to exit.
    Messages out: ("ready",) once, ("fatal", message, is_user_error) if loading failed, then
    (call_id, result, None) or (call_id, None, error message) per call.

    Args:
        conn: the worker's end of its pipe to the owner.
        load: resolves spec to the function, here in the worker.
        spec: what names the function (sent to load).
        log_path: where the function's own prints go (stdout and stderr); None = inherited.
        scrub_env: environment variables removed before the function is loaded (secrets it must not see).
    """
    for name in scrub_env:
        os.environ.pop(name, None)
    # A worker outlives a SIGKILLed trainer otherwise (lifetime.py); its parent is the forkserver,
    # which exits when the trainer does.
    die_with_parent()
    # A process group of its own: what the function starts (a sandbox, a shell) is stopped with the
    # worker (WorkerSet._stop kills the group); it outlived the check before. This also keeps
    # Ctrl-C, sent to the trainer's group, away from the worker: the owner handles it.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    # A child that leaves the group (setsid) still ends with the worker: its orphans come back to
    # the worker, which _stop kills with all it finds below it (lifetime.kill_descendants).
    become_subreaper()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_path is not None:
        # A function that prints per call (154 MB in one report) would flood the trainer's
        # console and bury its one-line errors: its output goes to a file of the run.
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        _serve(conn, load, spec)
    finally:  # a worker that leaves by itself takes what its function started, as _stop would
        kill_descendants()


def _serve(conn: Connection, load: Loader, spec: Any) -> None:
    try:
        fn = load(spec)
    except UserError as err:  # the loader's own words: the spec, the module, the fix
        conn.send(("fatal", str(err), True))
        return
    except Exception as err:
        conn.send(("fatal", f"{type(err).__name__}: {err}", False))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the owner's process is gone
            return
        if message is None:
            return
        call_id, args = message
        try:
            conn.send((call_id, fn(*args), None))
        except Exception as err:  # includes a result that cannot be pickled
            conn.send((call_id, None, f"{type(err).__name__}: {err}"))


class WorkerSet:
    """num_workers processes running one user function; starts them and waits until all loaded it.

    Args:
        load: resolves spec in each worker (module-level, so it pickles by reference).
        spec: names the function; sent to every worker.
        num_workers: worker processes (>= 1).
        label: the function in messages, e.g. "reward function 'pkg.mod:score'".
        timeout_s: seconds one call may take before its worker is killed.
        start_timeout_s: seconds a worker may take to start and load the function.
        start_method: "forkserver" or "spawn" (choose_start_method).
        log_path: file that receives what the function prints; None = the console.
        slow_hint: the setting to raise when loading is only slow, e.g. "reward.timeout_s".
        process_name: the workers' process name.
        scrub_env: environment variables the workers drop before loading the function.

    Raises:
        UserError: a worker could not load the function, exited or hung while loading it.
    """

    def __init__(self, load: Loader, spec: Any, num_workers: int, *, label: str, timeout_s: float,
                 start_timeout_s: float, start_method: str, log_path: str | None, slow_hint: str,
                 process_name: str, scrub_env: tuple[str, ...] = ()) -> None:
        self.load, self.spec, self.label = load, spec, label
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.log_path = log_path
        self.slow_hint = slow_hint
        self.process_name = process_name
        self.scrub_env = tuple(scrub_env)
        self._context = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self._next_call_id = 0
        try:
            self._workers = [self._start_worker() for _ in range(num_workers)]
            while not all(worker.ready for worker in self._workers):
                self.poll()
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> Iterator[_Worker]:
        return iter(self._workers)

    def idle(self) -> list[_Worker]:
        """Workers ready for a call."""
        return [worker for worker in self._workers if worker.ready and worker.task is None]

    def running(self) -> list[Any]:
        """The tokens of the calls in flight."""
        return [worker.task for worker in self._workers if worker.task is not None]

    def send(self, worker: _Worker, task: Any, args: Sequence[Any]) -> bool:
        """Start a call on an idle worker; its deadline runs from now.

        Returns:
            False if the worker had died while idle: it is replaced, and the call is not started
            (the owner gives it to a worker again).
        """
        assert worker.ready and worker.task is None, "a worker runs one call at a time"
        self._next_call_id += 1
        try:
            worker.conn.send((self._next_call_id, tuple(args)))
        except OSError:
            self._replace(worker)
            return False
        worker.task, worker.call_id = task, self._next_call_id
        worker.deadline = time.monotonic() + self.timeout_s
        return True

    def poll(self, extra: Sequence[Any] = ()) -> list[Outcome]:
        """Wait for the next message or deadline among busy workers (or for one of `extra`), and act on it.

        Args:
            extra: more objects for multiprocessing.connection.wait (a wake-up pipe); the wait
                ends when one is readable, and reading it is the caller's.

        Returns:
            The calls that ended: answered, raised, timed out (the worker is replaced) or lost
            with their worker (replaced too).

        Raises:
            UserError: a worker could not load the function, or did not within start_timeout_s.
        """
        busy = [worker for worker in self._workers if worker.task is not None or not worker.ready]
        if not busy and not extra:
            return []
        next_deadline = min((worker.deadline for worker in busy), default=math.inf)
        timeout = None if next_deadline == math.inf else max(0.0, next_deadline - time.monotonic())
        ready = wait([*(worker.conn for worker in busy), *extra], timeout=timeout)
        outcomes: list[Outcome] = []
        for worker in busy:
            if worker.conn in ready:
                try:
                    message = worker.conn.recv()
                except (EOFError, OSError):
                    worker.process.join(timeout=5.0)
                    message = None
                self._handle(worker, message, outcomes)
            elif time.monotonic() >= worker.deadline:
                if not worker.ready:
                    raise UserError(
                        f"{self.label}: importing it in a worker did not finish within {self.start_timeout_s:g} s "
                        f"(does its module hang or wait at import?); make the import quick, or raise "
                        f"{self.slow_hint} if it is only slow"
                    )
                outcomes.append(Outcome(worker.task, error=f"timeout after {self.timeout_s} s", timed_out=True))
                self._replace(worker)
        return outcomes

    def close(self) -> None:
        """Stop the workers (idempotent). Running calls are abandoned."""
        for worker in self._workers:
            with contextlib.suppress(OSError):  # a dead worker needs no stop message
                worker.conn.send(None)
        for worker in self._workers:
            worker.process.join(timeout=1.0)
            self._stop(worker)
        self._workers = []

    def _start_worker(self) -> _Worker:
        """Start one worker process; it becomes ready once it has loaded the function."""
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(target=_worker_main, args=(child_conn, self.load, self.spec, self.log_path, self.scrub_env),
                                        name=self.process_name, daemon=True)
        process.start()
        # Without the parent's copy of the child end, a dead worker reads as EOF.
        child_conn.close()
        worker = _Worker(process, parent_conn)
        worker.deadline = time.monotonic() + self.start_timeout_s
        return worker

    @staticmethod
    def _stop(worker: _Worker) -> None:
        """Kill a worker and the processes its function started (its group), release its pipe."""
        pid = worker.process.pid
        if pid is not None:
            kill_descendants(pid)  # in sessions of their own too: the worker is their subreaper
            with contextlib.suppress(OSError):  # the group is the worker's own (_worker_main), or gone
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5.0)
        with contextlib.suppress(OSError):  # children of an already-dead worker keep its group id
            os.killpg(pid, signal.SIGKILL)
        worker.conn.close()

    def _replace(self, worker: _Worker) -> None:
        """Kill a hung or dead worker and start a fresh one in its place."""
        self._stop(worker)
        self._workers[self._workers.index(worker)] = self._start_worker()

    def _handle(self, worker: _Worker, message: tuple | None, outcomes: list[Outcome]) -> None:
        """Act on one message from a worker, or on its death (message None)."""
        if message is None:
            exit_code = worker.process.exitcode
            if not worker.ready:
                raise UserError(
                    f"{self.label}: its worker exited with code {exit_code} while importing it "
                    "(the module exits or crashes at import); run `python -c 'import <module>'` to see why"
                )
            if worker.task is not None:
                outcomes.append(Outcome(worker.task, error=f"worker process died (exit code {exit_code})"))
            self._replace(worker)
        elif message[0] == "ready":
            worker.ready = True
            worker.deadline = math.inf
        elif message[0] == "fatal":
            if message[2]:
                raise UserError(f"{message[1]} (in a worker process: the module must be importable by name "
                                "from a fresh interpreter, not __main__)")
            raise UserError(
                f"{self.label} failed to load in a worker process: {message[1]}; "
                "the module must be importable by name from a fresh interpreter (not __main__)"
            )
        else:
            call_id, result, error = message
            assert call_id == worker.call_id, f"worker answered call {call_id}, expected {worker.call_id}"
            outcomes.append(Outcome(worker.task, result=result, error=error))
            worker.task = None
            worker.deadline = math.inf
