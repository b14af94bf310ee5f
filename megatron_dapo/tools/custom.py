"""Custom tools: a user's "package.module:function" answers the policy's calls, in worker processes.

A custom tool is ``f(argument: str) -> str``: the call's argument in, the answer the policy
sees out. It is a user's code, so it runs where it cannot stop the trainer, in the reward
pool's workers (rewards/workers.py): forkserver processes that import every custom tool once,
each call with ``tools.custom_timeout_s``, a worker that hangs or dies killed and replaced,
what the functions print in ``tool_workers.log`` of the run, the workers gone with the trainer.

A custom tool is trusted code of the run's user, not sandboxed like the python tool: its
workers run as the trainer's user, with its files, network and processes within reach. What
they are spared is the engines' key: ENGINE_KEY_ENV is removed from their environment before
the tools load (a tool has no business with the engines' admin and weight routes).

An answer longer than ``MAX_ANSWER_CHARS`` is cut in the middle in the worker, so a tool that
returns hundreds of megabytes never sends them to the trainer (the episode runner cuts further,
to the answer's tokens).

A tool's failure is its answer, never the trainer's exception: a call that raised, timed out,
lost its worker or returned something other than a str answers ``error: ...`` with status
"failed", which the episode runner's breaker counts (tools.max_failure_fraction), as the reward
pool counts its failed calls.

The episode runner calls tools from ``calls_in_flight`` threads, and several runners' generate
calls may run at once, while a WorkerSet has one owner. So one dispatcher thread owns the
workers: a call is queued with a future, the dispatcher hands queued calls to idle workers (N
workers, up to N calls at once) and resolves each future when its call ends; a pipe wakes it
when a call is queued.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future

from megatron_dapo.errors import UserError
from megatron_dapo.rewards.registry import UserFnContract, import_user_fn
from megatron_dapo.rewards.workers import Outcome, WorkerSet, choose_start_method
from megatron_dapo.tools.sandbox import ToolResult

__all__ = ["ENGINE_KEY_ENV", "MAX_ANSWER_CHARS", "TOOL_CONTRACT", "TOOL_LOG", "CustomToolPool", "check_custom_tools",
           "load_tools"]

TOOL_LOG = "tool_workers.log"
"""What custom tools print in the workers, under trainer.output_dir."""
ENGINE_KEY_ENV = ("VLLM_API_KEY", "SGLANG_API_KEY")
"""Environment variables that hold an engine's key (rollout/vllm/engine.py sets VLLM_API_KEY for its
servers; a user may export either for engines of their own): never in a tool worker's environment."""
MAX_ANSWER_CHARS = 1 << 20
"""Characters of an answer a worker sends back (head and tail, " ... " between)."""
START_TIMEOUT_S = 60.0
"""How long a worker may take to import the custom tools (or tools.custom_timeout_s, if longer)."""

TOOL_CONTRACT = UserFnContract(
    what="tool", expected_form="expected a built-in tool (calculator, python) or 'package.module:function' with "
    "the module importable from PYTHONPATH", call_form="f(argument)", signature="f(argument: str) -> str",
    probe_args=("",))


def load_tools(specs: tuple[tuple[str, str], ...]) -> Callable[[str, str], str]:
    """In a worker: import every custom tool; the returned function runs one call, by tool name.

    Raises:
        UserError: a spec names nothing callable as f(argument) (import_user_fn's line).
    """
    fns = {name: import_user_fn(spec, TOOL_CONTRACT) for name, spec in specs}

    def call(name: str, argument: str) -> str:
        answer = fns[name](argument)
        if not isinstance(answer, str):
            raise TypeError(f"the tool returned {type(answer).__name__} {answer!r:.40}, not a str")
        if len(answer) > MAX_ANSWER_CHARS:
            half = (MAX_ANSWER_CHARS - 5) // 2
            answer = f"{answer[:half]} ... {answer[-half:]}"
        return answer

    return call


class CustomToolPool:
    """Worker processes answering calls of the custom tools; call() is safe from any thread.

    Args:
        specs: tool name -> "package.module:function".
        num_workers: worker processes (calls run at once).
        timeout_s: seconds one call may take.
        log_path: file that receives what the tools print; None = the console.
        start_timeout_s: seconds a worker may take to import the tools; None = max(60, timeout_s).
        start_method: "forkserver" or "spawn"; None picks forkserver where available.

    Raises:
        UserError: a spec does not load in the workers (its one line), or its import hangs.
    """

    def __init__(self, specs: Mapping[str, str], num_workers: int, timeout_s: float, *,
                 log_path: str | os.PathLike[str] | None = None, start_timeout_s: float | None = None,
                 start_method: str | None = None) -> None:
        self.specs = dict(specs)
        self.timeout_s = float(timeout_s)
        self._workers = WorkerSet(
            load_tools, tuple(self.specs.items()), num_workers, label=f"tools.tools {list(self.specs.values())}",
            timeout_s=self.timeout_s, start_timeout_s=start_timeout_s or max(START_TIMEOUT_S, self.timeout_s),
            start_method=choose_start_method(start_method, "CustomToolPool"),
            log_path=None if log_path is None else str(log_path), slow_hint="tools.custom_timeout_s",
            process_name="tool-worker", scrub_env=ENGINE_KEY_ENV)
        self._lock = threading.Lock()
        self._queued: deque[tuple[str, str, Future[Outcome]]] = deque()
        self._closing = False
        self._stopped: str | None = None  # why calls are no longer run (closed, or the dispatcher failed)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._dispatch, name="custom-tools", daemon=True)
        self._thread.start()

    def __enter__(self) -> CustomToolPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def tool(self, name: str) -> Callable[[str], ToolResult]:
        """The tool of the episode runner's tool set (tools/episode.Tool) for one custom tool."""
        if name not in self.specs:
            raise KeyError(f"no custom tool named {name!r} (custom tools: {sorted(self.specs)})")
        return functools.partial(self.call, name)

    def call(self, name: str, argument: str) -> ToolResult:
        """Run one call in a worker and wait for it; a failure is the answer (status "failed")."""
        start = time.monotonic()
        future: Future[Outcome] = Future()
        with self._lock:
            stopped = self._stopped
            if stopped is None:
                self._queued.append((name, argument, future))
                self._wake()
        if stopped is not None:
            return ToolResult(f"error: {stopped}", "failed", 0.0, "worker process")
        outcome = future.result()
        seconds = time.monotonic() - start
        if outcome.error is None:
            return ToolResult(outcome.result, "ok", seconds, "worker process")
        text = f"the tool timed out after {self.timeout_s:g} s" if outcome.timed_out else outcome.error
        return ToolResult(f"error: {text}", "failed", seconds, "worker process")

    def close(self) -> None:
        """Stop the dispatcher and the workers (idempotent); calls still queued or running fail."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._wake()
        self._thread.join()
        with self._lock:  # no caller writes to the descriptor's number once it is closed (and reused)
            wake_w, self._wake_w = self._wake_w, -1
        os.close(wake_w)
        os.close(self._wake_r)

    def _wake(self) -> None:
        """Wake the dispatcher; called with the lock held."""
        if self._wake_w >= 0:
            with contextlib.suppress(BlockingIOError):  # a full pipe already holds a wake-up
                os.write(self._wake_w, b"x")

    def _dispatch(self) -> None:
        """The dispatcher thread: queued calls to idle workers, ended calls to their futures."""
        pending: deque[tuple[str, str, Future[Outcome]]] = deque()
        reason = "the tool pool is closed"
        try:
            while True:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
                with self._lock:
                    pending.extend(self._queued)
                    self._queued.clear()
                    if self._closing:
                        break
                for worker in self._workers.idle():
                    if not pending:
                        break
                    name, argument, future = pending.popleft()
                    if not self._workers.send(worker, future, (name, argument)):
                        pending.appendleft((name, argument, future))  # died while idle; its replacement takes it
                for outcome in self._workers.poll(extra=(self._wake_r,)):
                    outcome.task.set_result(outcome)
        except Exception as err:  # a replacement worker that cannot load the tools: every call fails from now
            reason = str(err) if isinstance(err, UserError) else f"the tool pool stopped ({type(err).__name__}: {err})"
        finally:
            with self._lock:
                self._stopped = reason
                pending.extend(self._queued)
                self._queued.clear()
            for future in [*self._workers.running(), *(f for _, _, f in pending)]:
                future.set_result(Outcome(future, error=reason))
            self._workers.close()


def check_custom_tools(specs: Mapping[str, str], timeout_s: float) -> None:
    """Import the custom tools in one worker, as the run's workers will (`config validate`).

    Raises:
        UserError: a spec does not load (no module, no function, not callable as f(argument)),
            or its import hangs.
    """
    if specs:
        with CustomToolPool(specs, 1, timeout_s, log_path=os.devnull):
            pass
