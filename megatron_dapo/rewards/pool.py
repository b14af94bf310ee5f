"""Score a batch of responses in worker processes, with a timeout on every call.

Step 2 of the RL step (DESIGN.md) runs on the controller, next to torch and gloo
threads, and calls a reward function that may be a user's code. One slow or crashing
call must cost one sample, not the run: every call gets `timeout_s`, a call that raises,
times out or kills its worker scores -1.0 with acc False, and the batch's counts of
errors and timeouts are returned (and logged) so a broken reward shows in the metrics.

Why not concurrent.futures.ProcessPoolExecutor: it cannot stop a running task, and a
worker that dies breaks the whole executor. Here each worker is a process with its own
pipe; the pool hands a worker one task at a time, so it always knows which call a worker
is running, kills the worker when that call's deadline passes and starts a fresh one.
Workers start with "forkserver" (or "spawn" where forkserver is missing): a fresh
interpreter, never a fork of a process that holds threads and communicator state.

Workers are daemon processes so that they die with the controller, also after kill -9
(lifetime.py); a reward function therefore cannot start processes of its own. The pool is not thread-safe.
"""

import contextlib
import logging
import math
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from megatron_dapo.errors import UserError
from megatron_dapo.lifetime import die_with_parent
from megatron_dapo.rewards.registry import RewardFn, get_reward_fn

logger = logging.getLogger(__name__)

# Score and accuracy of a call that raised, timed out or lost its worker (DAPO's "wrong").
FAILURE_SCORE = -1.0
# Longest response sent to a worker; answers sit at the end, so the tail is kept.
# 200k characters is about 50k tokens, over twice DAPO's 20480-token L_max.
DEFAULT_MAX_RESPONSE_CHARS = 200_000

RewardInput = tuple[str, str, dict | None]
# The circuit breaker judges a batch from this many finished calls on (or all, if fewer).
BREAKER_MIN_CALLS = 16
REWARD_LOG = "reward_workers.log"
"""What a reward function prints in the workers, under trainer.output_dir."""


PROBE_IMPORT_TIMEOUT_S = 60.0
"""How long the probe waits for a user's reward module to import (or reward.timeout_s, if longer)."""


class RewardFunctionBroken(UserError):
    """Most calls of a batch failed: the reward function, not the responses, is at fault."""


@dataclass(kw_only=True, slots=True)
class RewardStats:
    """What happened while scoring one batch."""

    num_calls: int
    """Responses scored (the batch size)."""
    num_errors: int
    """Calls that raised or whose worker died; each scored FAILURE_SCORE."""
    num_timeouts: int
    """Calls stopped after timeout_s; each scored FAILURE_SCORE."""
    num_truncated: int
    """Responses cut to their last max_response_chars characters before scoring."""
    first_error: str | None
    """Message of the first failed call in input order, or None."""


class _Worker:
    """One worker process, its pipe, and the call it is running."""

    __slots__ = ("conn", "deadline", "process", "ready", "task")

    def __init__(self, process: Any, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.ready = False  # set when the worker has imported the reward function
        self.task: int | None = None  # batch index of the call it is running
        self.deadline = math.inf  # monotonic time: end of start-up, or of the running call


def _worker_main(conn: Connection, fn_spec: str, log_path: str | None = None) -> None:
    """Loop of a worker process: load the reward function, then score until told to stop.

    Messages in: (index, solution_str, ground_truth, extra_info), or None to exit.
    Messages out: ("ready",) once, ("fatal", message) if loading failed, then
    (index, result dict, None) or (index, None, error message) per call.

    Args:
        conn: the worker's end of its pipe to the pool.
        fn_spec: the reward function spec, resolved here with get_reward_fn.
        log_path: where the function's own prints go (stdout and stderr); None = inherited.
    """
    # A worker outlives a SIGKILLed trainer otherwise (lifetime.py); its parent is the forkserver,
    # which exits when the trainer does.
    die_with_parent()
    # A process group of its own: what the reward function starts (a sandbox, a shell) is stopped
    # with the worker (RewardPool._stop kills the group); it outlived the check before. This also
    # keeps Ctrl-C, sent to the trainer's group, away from the worker: the pool handles it.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_path is not None:
        # A reward function that prints per call (154 MB in one report) would flood the trainer's
        # console and bury its one-line errors: its output goes to a file of the run.
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        fn = get_reward_fn(fn_spec)
    except UserError as err:  # get_reward_fn's own words: the spec, the module, the fix
        conn.send(("fatal", str(err), True))
        return
    except Exception as err:
        conn.send(("fatal", f"{type(err).__name__}: {err}", False))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the pool's process is gone
            return
        if message is None:
            return
        index, solution_str, ground_truth, extra_info = message
        try:
            conn.send((index, fn(solution_str, ground_truth, extra_info), None))
        except Exception as err:  # includes a result that cannot be pickled
            conn.send((index, None, f"{type(err).__name__}: {err}"))


class _Batch:
    """Results of one batch as they arrive, and which calls failed how."""

    __slots__ = ("failures", "results")

    def __init__(self, num_calls: int) -> None:
        self.results: list[dict[str, Any] | None] = [None] * num_calls
        self.failures: dict[int, tuple[bool, str]] = {}  # index -> (timed out, message)

    def broken(self, max_failure_fraction: float) -> bool:
        """True once enough calls finished and more than the given share of them failed."""
        num_done = sum(r is not None for r in self.results)
        return (num_done >= min(BREAKER_MIN_CALLS, len(self.results)) and num_done > 0
                and len(self.failures) > max_failure_fraction * num_done)

    def fail(self, index: int, error: str, *, timed_out: bool = False) -> None:
        """Record a failed call: it scores FAILURE_SCORE and its result names the error."""
        self.results[index] = {"score": FAILURE_SCORE, "acc": False, "error": error}
        self.failures[index] = (timed_out, error)


class RewardPool:
    """Reward function calls in worker processes, each with a timeout.

    Use as a context manager, or call close(). With num_workers=0 the function runs in
    the calling process, for debugging: errors are still caught and counted, but a call
    that hangs hangs the caller, since a thread cannot be stopped from outside.

    Args:
        fn_spec: reward function name or "package.module:function" (see registry).
        num_workers: worker processes; 0 scores in-process without timeouts.
        timeout_s: seconds one call may take before its worker is killed.
        max_response_chars: responses longer than this keep only their tail.
        start_timeout_s: seconds a worker may take to start and import fn_spec.
        start_method: "forkserver" or "spawn"; None picks forkserver where available.
        max_failure_fraction: score_batch raises RewardFunctionBroken once more than this
            share of a batch's finished calls failed (from BREAKER_MIN_CALLS calls on):
            a function that always fails would otherwise train on constant -1, and a hung
            one cost timeout_s per call. 1.0 = never.
        log_path: file that receives what the function prints in the workers; None = the console.

    Raises:
        UserError: a bad argument, or fn_spec that does not resolve (in the workers too).
    """

    def __init__(
        self,
        fn_spec: str,
        num_workers: int,
        timeout_s: float,
        *,
        max_response_chars: int = DEFAULT_MAX_RESPONSE_CHARS,
        start_timeout_s: float = 120.0,
        start_method: str | None = None,
        max_failure_fraction: float = 1.0,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise UserError(
                f"RewardPool num_workers={num_workers!r}: expected an int >= 0 (0 scores in-process)"
            )
        for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise UserError(f"RewardPool {name}={value!r}: expected a finite number of seconds > 0")
        if (
            isinstance(max_response_chars, bool)
            or not isinstance(max_response_chars, int)
            or max_response_chars < 1
        ):
            raise UserError(f"RewardPool max_response_chars={max_response_chars!r}: expected an int >= 1")
        methods = mp.get_all_start_methods()
        if start_method is None:
            start_method = "forkserver" if "forkserver" in methods else "spawn"
        if start_method not in ("forkserver", "spawn") or start_method not in methods:
            raise UserError(
                f"RewardPool start_method={start_method!r}: expected one of "
                f"{[m for m in ('forkserver', 'spawn') if m in methods]} (fork is unsafe beside torch threads)"
            )
        self.fn_spec = fn_spec
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.max_response_chars = max_response_chars
        self.start_timeout_s = float(start_timeout_s)
        if not 0 < max_failure_fraction <= 1:
            raise UserError(f"RewardPool max_failure_fraction={max_failure_fraction!r}: expected a share in (0, 1]")
        self.max_failure_fraction = float(max_failure_fraction)
        self.log_path = None if log_path is None else str(log_path)
        # In-process only where it runs here (num_workers=0) or cannot hang (a built-in): a user's
        # module is imported in the workers, under start_timeout_s (its import may hang or print).
        self._fn: RewardFn | None = get_reward_fn(fn_spec) if num_workers == 0 or ":" not in fn_spec else None
        self._context = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self._closed = False
        if num_workers == 0:
            logger.warning(
                "RewardPool(%r) with num_workers=0 scores in-process: timeout_s=%s is not enforced",
                fn_spec,
                timeout_s,
            )
            return
        try:
            self._workers = [self._start_worker() for _ in range(num_workers)]
            while not all(worker.ready for worker in self._workers):
                self._poll([worker for worker in self._workers if not worker.ready], _Batch(0))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def score_batch(self, batch: Sequence[RewardInput]) -> tuple[list[dict[str, Any]], RewardStats]:
        """Score every (solution_str, ground_truth, extra_info) of a batch.

        Args:
            batch: the responses with their reference answers and dataset extra_info.

        Returns:
            (results, stats): one dict per input, in input order, each with at least
            "score" (float) and "acc" (bool); failed calls also carry "error". stats
            counts the failures; a warning naming the first one is logged if any.

        Raises:
            RuntimeError: the pool is closed, or a replacement worker did not start
                (UserError if it could not load fn_spec). Any exception out of this
                method, Ctrl-C included, closes the pool.
        """
        if self._closed:
            raise RuntimeError(f"RewardPool({self.fn_spec!r}) is closed; create a new pool to score more")
        calls: list[RewardInput] = []
        num_truncated = 0
        for solution_str, ground_truth, extra_info in batch:
            if isinstance(solution_str, str) and len(solution_str) > self.max_response_chars:
                solution_str = solution_str[-self.max_response_chars :]
                num_truncated += 1
            calls.append((solution_str, ground_truth, extra_info))

        done = _Batch(len(calls))
        if self._workers:
            try:
                self._score_in_workers(calls, done)
            except BaseException:
                # Calls still in flight would answer into the next batch: stop them all.
                self.close()
                raise
        else:
            for index, (solution_str, ground_truth, extra_info) in enumerate(calls):
                try:
                    done.results[index] = self._fn(solution_str, ground_truth, extra_info)
                except Exception as err:
                    done.fail(index, f"{type(err).__name__}: {err}")
                if done.broken(self.max_failure_fraction):
                    raise self._broken(done)

        num_timeouts = sum(timed_out for timed_out, _ in done.failures.values())
        stats = RewardStats(
            num_calls=len(calls),
            num_errors=len(done.failures) - num_timeouts,
            num_timeouts=num_timeouts,
            num_truncated=num_truncated,
            first_error=done.failures[min(done.failures)][1] if done.failures else None,
        )
        if done.failures:
            logger.warning(
                "reward %r: %d of %d calls failed (%d errors, %d timeouts of %.1f s), scored %s; first: %s",
                self.fn_spec,
                len(done.failures),
                stats.num_calls,
                stats.num_errors,
                stats.num_timeouts,
                self.timeout_s,
                FAILURE_SCORE,
                stats.first_error,
            )
        assert all(result is not None for result in done.results), "every call must end with a result"
        return done.results, stats  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the workers (idempotent). Running calls are abandoned."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            with contextlib.suppress(OSError):  # a dead worker needs no stop message
                worker.conn.send(None)
        for worker in self._workers:
            worker.process.join(timeout=1.0)
            self._stop(worker)
        self._workers = []

    def _start_worker(self) -> _Worker:
        """Start one worker process; it becomes ready once it has loaded fn_spec."""
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_main, args=(child_conn, self.fn_spec, self.log_path), name="reward-worker", daemon=True
        )
        process.start()
        # Without the parent's copy of the child end, a dead worker reads as EOF.
        child_conn.close()
        worker = _Worker(process, parent_conn)
        worker.deadline = time.monotonic() + self.start_timeout_s
        return worker

    @staticmethod
    def _stop(worker: _Worker) -> None:
        """Kill a worker and the processes its reward function started (its group), release its pipe."""
        pid = worker.process.pid
        if pid is not None:
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

    def _score_in_workers(self, calls: list[RewardInput], done: _Batch) -> None:
        """Hand calls to idle workers, one at a time each, until all have results."""
        queue = deque(range(len(calls)))
        while queue or any(worker.task is not None for worker in self._workers):
            for worker in list(self._workers):
                if queue and worker.ready and worker.task is None:
                    index = queue.popleft()
                    try:
                        worker.conn.send((index, *calls[index]))
                    except OSError:  # the worker died while idle; its replacement takes the call
                        queue.appendleft(index)
                        self._replace(worker)
                        continue
                    worker.task = index
                    worker.deadline = time.monotonic() + self.timeout_s
            self._poll([w for w in self._workers if w.task is not None or not w.ready], done)
            if done.broken(self.max_failure_fraction):
                raise self._broken(done)

    def _broken(self, done: _Batch) -> RewardFunctionBroken:
        num_done = sum(r is not None for r in done.results)
        num_timeouts = sum(timed_out for timed_out, _ in done.failures.values())
        return RewardFunctionBroken(
            f"reward function {self.fn_spec!r} failed on {len(done.failures)} of {num_done} calls "
            f"({len(done.failures) - num_timeouts} errors, {num_timeouts} timeouts of {self.timeout_s:g} s), more "
            f"than reward.max_failure_fraction={self.max_failure_fraction:g}; first: "
            f"{done.failures[min(done.failures)][1]}. Fix the reward function (or raise reward.timeout_s if it is "
            "only slow)"
        )

    def _poll(self, busy: list[_Worker], done: _Batch) -> None:
        """Wait for the next message or deadline among busy workers, and act on it.

        Args:
            busy: workers that are starting or running a call.
            done: the batch, whose result at a finished call's index is filled in.

        Raises:
            UserError: a worker could not load the reward function.
            RuntimeError: a worker did not start within start_timeout_s.
        """
        if not busy:
            return
        next_deadline = min(worker.deadline for worker in busy)
        ready = wait([worker.conn for worker in busy], timeout=max(0.0, next_deadline - time.monotonic()))
        for worker in busy:
            if worker.conn in ready:
                try:
                    message = worker.conn.recv()
                except (EOFError, OSError):
                    worker.process.join(timeout=5.0)
                    message = None
                self._handle(worker, message, done)
            elif time.monotonic() >= worker.deadline:
                if not worker.ready:
                    raise UserError(
                        f"reward function {self.fn_spec!r}: importing it in a worker did not finish within "
                        f"{self.start_timeout_s:g} s (does its module hang or wait at import?); make the import "
                        "quick, or raise reward.timeout_s if it is only slow"
                    )
                done.fail(worker.task, f"timeout after {self.timeout_s} s", timed_out=True)
                self._replace(worker)

    def _handle(self, worker: _Worker, message: tuple | None, done: _Batch) -> None:
        """Act on one message from a worker, or on its death (message None)."""
        if message is None:
            exit_code = worker.process.exitcode
            if not worker.ready:
                raise UserError(
                    f"reward function {self.fn_spec!r}: its worker exited with code {exit_code} while importing it "
                    "(the module exits or crashes at import); run `python -c 'import <module>'` to see why"
                )
            if worker.task is not None:
                done.fail(worker.task, f"worker process died (exit code {exit_code})")
            self._replace(worker)
        elif message[0] == "ready":
            worker.ready = True
            worker.deadline = math.inf
        elif message[0] == "fatal":
            if message[2]:
                raise UserError(f"{message[1]} (in a worker process: the module must be importable by name "
                                "from a fresh interpreter, not __main__)")
            raise UserError(
                f"reward function {self.fn_spec!r} failed to load in a worker process: {message[1]}; "
                "the module must be importable by name from a fresh interpreter (not __main__)"
            )
        else:
            index, result, error = message
            assert index == worker.task, f"worker answered call {index}, expected {worker.task}"
            if error is None:
                done.results[index] = result
            else:
                done.fail(index, error)
            worker.task = None
            worker.deadline = math.inf


def probe_reward_fn(fn_spec: str, timeout_s: float, ground_truth: str, extra_info: dict[str, Any] | None = None) -> None:
    """Call a reward function once, in a worker with the run's timeout, before any work depends on it.

    A function that hangs would otherwise cost reward.timeout_s per call until the circuit
    breaker trips, minutes into the run; one that raises on every input is left to the
    breaker (it may only dislike the empty probe response).

    Raises:
        UserError: the call did not return within timeout_s.
    """
    # The import is bounded too (a module that hangs at import hung `config validate`), and what the
    # function prints goes nowhere: the console is for the one line (the run's log is reward_workers.log).
    with RewardPool(fn_spec, 1, timeout_s, start_timeout_s=max(timeout_s, PROBE_IMPORT_TIMEOUT_S),
                    log_path=os.devnull) as pool:
        _, stats = pool.score_batch([("", ground_truth, extra_info)])
    if stats.num_timeouts:
        raise UserError(f"reward function {fn_spec!r} did not return within reward.timeout_s={timeout_s:g} s on a "
                        f"probe call (an empty response against the answer {ground_truth[:40]!r}); fix the function "
                        "(it hangs) or raise reward.timeout_s if it is only slow")
