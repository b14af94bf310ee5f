"""A local engine in its own process: the CPU form of `rollout.placement: disaggregated`.

Colocated, the engine shares the actor's device and the two take turns. Disaggregated, the
engine runs on devices of its own and keeps generating while the actor trains (the
asynchronous loop of trainer.py, bounded by `trainer.max_staleness`). On CPU its "device"
is a process with its own threads: `ProcessEngine` is the controller's client, `serve`
runs in the child around a LocalEngine.

The two talk over one duplex pipe. Calls (generate, stream, weight buckets, health) carry a
request id and get one reply. A stream also runs the other way: the child asks the parent
for the next prompt of the controller's PromptFeed and hands each finished group to the
parent's callback, waiting for its acknowledgement before the next decode step, exactly
where the in-process engine calls them; an abort sent from the callback arrives before that
acknowledgement, so the stop point depends on token counts only, as in-process.

Weights travel as one flat tensor per dtype per bucket (flat_bucket.py) in shared memory
(torch's tensor pickling). The child holds the buckets of an update until its end and then
copies them all in between two decode steps (one extra copy of the weights in memory, so
no decode step runs on half-updated weights): generation pauses only for the copy, and
the rows in flight go on under the new weights,
each result listing the weight versions its tokens were sampled under (PipelineRL's
in-flight update; the KV cache of earlier tokens is kept). The child exits when the pipe
closes, so a controller killed with -9 leaves no engine behind.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # registers shared-memory pickling of tensors

from megatron_dapo.rollout.engine import EngineError, GenerationResult, SamplingParams
from megatron_dapo.rollout.flat_bucket import FlatBucket, flatten_by_dtype, unflatten
from megatron_dapo.rollout.streaming import FeedItem, GroupCallback, PromptFeed

__all__ = ["ProcessEngine", "serve"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    """The parent's side of one stream call: the feed the child takes from, the group callback."""

    feed: PromptFeed
    on_group: GroupCallback
    error: BaseException | None = None


class ProcessEngine:
    """A LocalEngine in a child process; implements RolloutEngine and StreamingEngine."""

    def __init__(
        self, model_path: str | Path, *, name: str = "local0", num_threads: int = 1, max_batch_size: int = 256,
        start_timeout_s: float = 300.0, call_timeout_s: float = 3600.0, hang_timeout_s: float = 120.0,
    ) -> None:
        """Start the child and wait until its model is loaded.

        Args:
            model_path: HF directory the child loads (weights included).
            name: engine name in messages and metrics.
            num_threads: torch threads of the child (its share of the CPU cores).
            max_batch_size: responses the child decodes together.
            start_timeout_s: how long loading may take.
            call_timeout_s: how long any call may take (a generation included).
            hang_timeout_s: a generating child that answers no ping for this long is killed as hung.

        Raises:
            EngineError: the child failed to start or to load the model.
        """
        self.name = name
        self.log_path: str | None = None  # the child logs to the trainer's stderr
        self._call_timeout_s = call_timeout_s
        self._hang_timeout_s = hang_timeout_s
        self._start_args = (str(model_path), name, num_threads, max_batch_size)
        self._start_timeout_s = start_timeout_s
        # restart() and shutdown() take turns: the run's end stops engines on threads of their own
        # while a stream may be restarting one (RolloutController.shutdown); both close the pipe.
        self._life = threading.Lock()
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(target=serve, args=(child_conn, *self._start_args),
                                    name=f"megatron-dapo-engine-{self.name}", daemon=True)
        self._process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._state = threading.Lock()
        # multiprocessing's Popen.poll is not thread-safe: when the reader thread and a caller
        # both wait on the child, one reaps it and the other's waitpid fails (ECHILD), leaving
        # is_alive() True and exitcode None for a dead child. Every wait goes through this lock.
        self._wait_lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, Future[Any]] = {}
        self._streams: dict[int, _Stream] = {}
        self._dead: str | None = None
        self._last_heard = time.monotonic()
        self._busy = 0  # generate/stream calls waiting on the child
        self._reader = threading.Thread(target=self._read, args=(self._conn, self._process), name=f"{self.name}-reader",
                                        daemon=True)
        self._reader.start()
        self._watchdog = threading.Thread(target=self._watch, args=(self._process,), name=f"{self.name}-watchdog",
                                          daemon=True)
        self._watchdog.start()
        self._call("health", timeout_s=self._start_timeout_s)

    def restart(self) -> None:
        """Kill the child (dead or hung) and start a fresh one from the HF checkpoint (RestartableEngine)."""
        with self._life:
            with contextlib.suppress(Exception):
                self._process.kill()
                self._join(timeout=10)
            with contextlib.suppress(Exception):
                self._conn.close()
            # The old child's reader marks the engine dead when its pipe closes: let it finish first, or
            # its mark can land after _start() reset it and fail the new child's first call (seen under
            # load in tests/unit/test_engine_restart.py: "its process (pid N) exited with code -9").
            reader = getattr(self, "_reader", None)
            if reader is not None and reader is not threading.current_thread():
                reader.join(timeout=15)
            self._start()

    def _watch(self, process: Any) -> None:
        """While a generation runs, ping the child; one that answers nothing for hang_timeout_s is killed
        (its reader then fails the call as for a dead child, and the controller may restart it).

        The child answers pings between two decode steps, so only a stuck one stays silent.
        """
        interval = max(0.05, min(10.0, self._hang_timeout_s / 4))
        while self._process is process and self._dead is None:
            time.sleep(interval)
            if self._busy == 0:
                self._last_heard = time.monotonic()
                continue
            silent = time.monotonic() - self._last_heard
            if silent > self._hang_timeout_s:
                logger.warning("engine %s answered nothing for %.0f s while generating: killing its process (pid %s)",
                               self.name, silent, process.pid)
                with contextlib.suppress(Exception):
                    process.kill()
                return
            with contextlib.suppress(Exception):
                self._send(("call", next(self._ids), "health", (), {}))  # its reply only refreshes _last_heard

    # ------------------------------------------------------------------ RolloutEngine

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, index_offset: int = 0
    ) -> list[GenerationResult]:
        """Sample ``params.n`` responses per prompt in the child (see RolloutEngine.generate)."""
        with self._generating():
            return self._call("generate", [list(p) for p in prompts], params, index_offset=index_offset)

    def stream(
        self, feed: PromptFeed, params: SamplingParams, on_group: GroupCallback, *, max_inflight: int
    ) -> list[GenerationResult]:
        """Stream groups for prompts taken from `feed` (see StreamingEngine.stream).

        `on_group` runs on this client's reader thread; an error it raises aborts the child's
        stream and is raised here once the child has stopped.
        """
        rid = next(self._ids)
        session = _Stream(feed=feed, on_group=on_group)
        with self._state:
            self._streams[rid] = session
        try:
            with self._generating():
                incomplete = self._call("stream", params, max_inflight, rid=rid)
        except EngineError as err:
            if session.error is not None:  # the callback's failure came first
                raise session.error from err
            raise
        finally:
            with self._state:
                self._streams.pop(rid, None)
        if session.error is not None:
            raise session.error
        return incomplete

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Send one bucket, one flat shared-memory tensor per dtype; the child loads it between steps."""
        flats = flatten_by_dtype([(name, t.detach().to("cpu")) for name, t in bucket])
        self._call("update_weights", flats)

    def finish_weight_update(self, version: int | None = None) -> None:
        """End the update; from the next decode step the child samples under `version`."""
        self._call("finish_weight_update", version=version)

    def release_memory(self) -> None:
        """Nothing to release: the child's memory is its own."""

    def resume_memory(self) -> None:
        """Nothing to take back (see release_memory)."""

    def abort(self) -> None:
        """Stop the child's running generation after its current decode step (no reply awaited)."""
        if self._dead is None:
            self._send(("abort",))

    def clear_abort(self) -> None:
        """Nothing to clear: the child starts each generate()/stream() call unaborted (one session)."""

    def health(self) -> bool:
        """Whether the child is alive and answers."""
        if self._dead is not None or not self._alive():
            return False
        try:
            return bool(self._call("health", timeout_s=30.0))
        except EngineError:
            return False

    def shutdown(self) -> None:
        """Stop the child (it finishes its current decode step first); after a restart under way."""
        with self._life:
            if self._alive():
                with contextlib.suppress(OSError, EngineError):
                    self._send(("shutdown",))
                self._join(timeout=30)
                if self._alive():
                    self._process.kill()
                    self._join(timeout=10)
            self._conn.close()

    @contextlib.contextmanager
    def _generating(self) -> Any:
        with self._state:
            self._busy += 1
            self._last_heard = time.monotonic()
        try:
            yield
        finally:
            with self._state:
                self._busy -= 1

    def _alive(self) -> bool:
        with self._wait_lock:
            return self._process.is_alive()

    def _join(self, timeout: float, process: Any = None) -> int | None:
        """Wait for the child (or `process`, an earlier one) to exit; its exit code (None while it runs)."""
        process = self._process if process is None else process
        with self._wait_lock:
            process.join(timeout=timeout)
            return process.exitcode

    # ------------------------------------------------------------------ the pipe

    def _send(self, message: tuple[Any, ...]) -> None:
        process = self._process
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as err:  # ValueError: the pipe was closed
            raise _PipeLost(self.name, self._lost(process, err)) from err

    def _lost(self, process: Any, err: BaseException) -> str:
        """Why the pipe to `process` failed: its exit, once it has exited, else the pipe's error.

        A child killed mid-call breaks the pipe before the reader thread has recorded its exit
        (whichever thread gets there first): wait for the exit so that both name it.
        """
        if self._dead is not None:
            return self._dead
        code = self._join(timeout=5, process=process)
        return f"its process (pid {process.pid}) exited with code {code}" if code is not None else \
            f"cannot reach its process ({type(err).__name__}: {err})"

    def _call(self, method: str, *args: Any, rid: int | None = None, timeout_s: float | None = None,
              **kwargs: Any) -> Any:
        rid = next(self._ids) if rid is None else rid
        future: Future[Any] = Future()
        with self._state:
            if self._dead is not None:
                raise EngineError(f"engine {self.name}: {self._dead}")
            self._pending[rid] = future
        self._send(("call", rid, method, args, kwargs))
        try:
            return future.result(timeout=self._call_timeout_s if timeout_s is None else timeout_s)
        except FutureTimeout:
            raise EngineError(f"engine {self.name}: {method} got no answer in "
                              f"{self._call_timeout_s if timeout_s is None else timeout_s:.0f} s") from None
        finally:
            with self._state:
                self._pending.pop(rid, None)

    def _read(self, conn: Connection, process: Any) -> None:
        """The reader thread of one child: replies to calls, and the child's requests of a running stream."""
        while True:
            try:
                message = conn.recv()
                self._last_heard = time.monotonic()
            except (EOFError, OSError):
                if process is not self._process:  # restarted meanwhile: the new child has its own reader
                    return
                code = self._join(timeout=5)
                self._fail_all(f"its process (pid {process.pid}) exited with code {code}")
                return
            try:
                self._dispatch(message)
            except _PipeLost as err:  # the pipe broke while answering: the child is gone
                self._fail_all(err.why)
                return
            except Exception as err:  # nothing more can arrive
                self._fail_all(f"its client failed: {type(err).__name__}: {err}")
                return

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind, rid = message[0], message[1]
        if kind in ("reply", "error"):
            with self._state:
                future = self._pending.get(rid)
            if future is None:  # a call that timed out
                return
            if kind == "reply":
                future.set_result(message[2])
            else:
                future.set_exception(EngineError(f"engine {self.name}: {message[2]}"))
            return
        with self._state:
            session = self._streams.get(rid)
        if session is None:  # a stream this side gave up on (its call timed out): stop the child's
            self._send(("fed", rid, None) if kind == "take" else ("ack", rid, True))
            return
        if kind == "take":
            self._send(("fed", rid, self._take(session)))
        elif kind == "group":
            self._send(("ack", rid, self._hand_over(session, message[2])))

    @staticmethod
    def _take(session: _Stream) -> FeedItem | None:
        if session.error is not None:
            return None
        try:
            return session.feed.take(block=False)
        except BaseException as err:  # e.g. the sampler failed: raised by stream() once the child stopped
            session.error = err
            return None

    @staticmethod
    def _hand_over(session: _Stream, group: list[GenerationResult]) -> bool:
        """Give a finished group to the callback; True = the child must abort (the callback failed)."""
        if session.error is not None:
            return True
        try:
            session.on_group(group)
        except BaseException as err:  # raised by stream() once the child stopped
            session.error = err
            session.feed.close()
            return True
        return False

    def _fail_all(self, why: str) -> None:
        with self._state:
            self._dead = why
            pending = list(self._pending.values())
        for future in pending:
            if not future.done():
                future.set_exception(EngineError(f"engine {self.name}: {why}"))


class _PipeLost(EngineError):
    """The pipe to the child failed; `why` names the child's exit where it has exited."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"engine {name}: {why}")
        self.why = why


# ---------------------------------------------------------------------- the child


class _Shutdown(Exception):
    """The parent asked the child to stop (or went away)."""


class _Server:
    """The child's loop: one thread that decodes and, between decode steps, serves the pipe."""

    def __init__(self, conn: Connection, engine: Any) -> None:
        self.conn = conn
        self.engine = engine
        self.busy = False
        self.staged: list[FlatBucket] = []
        engine.between_steps = self.poll

    def run(self) -> None:
        try:
            while True:
                self.handle(self.recv())
        except _Shutdown:
            return

    def recv(self) -> tuple[Any, ...]:
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            raise _Shutdown from None
        if message[0] == "shutdown":
            raise _Shutdown
        return message

    def handle(self, message: tuple[Any, ...]) -> None:
        if message[0] == "abort":
            self.engine.abort()
            return
        _, rid, method, args, kwargs = message
        try:
            if method in ("generate", "stream") and self.busy:
                raise RuntimeError(f"{method} while another generation runs; one at a time")
            value = getattr(self, f"do_{method}")(rid, *args, **kwargs)
        except _Shutdown:
            raise
        except Exception as err:
            self.conn.send(("error", rid, f"{type(err).__name__}: {err}"))
            return
        self.conn.send(("reply", rid, value))

    def poll(self) -> None:
        """Between decode steps: serve what arrived (weight buckets, aborts, health)."""
        while self.conn.poll():
            self.handle(self.recv())

    def wait_for(self, kind: str, rid: int) -> tuple[Any, ...]:
        """The parent's answer to the child's request, serving other messages meanwhile."""
        while True:
            message = self.recv()
            if message[0] == kind and message[1] == rid:
                return message
            self.handle(message)

    def do_health(self, _rid: int) -> bool:
        return self.engine.health()

    def do_generate(self, _rid: int, prompts: list[list[int]], params: SamplingParams, *,
                    index_offset: int) -> list[GenerationResult]:
        self.busy = True
        try:
            return self.engine.generate(prompts, params, index_offset=index_offset)
        finally:
            self.busy = False

    def do_stream(self, rid: int, params: SamplingParams, max_inflight: int) -> list[GenerationResult]:
        server = self

        class Feed:  # what LocalEngine.stream asks of a PromptFeed
            @staticmethod
            def take(*, block: bool = True) -> FeedItem | None:
                server.conn.send(("take", rid))
                return server.wait_for("fed", rid)[2]

        def on_group(group: list[GenerationResult]) -> None:
            self.conn.send(("group", rid, group))
            if self.wait_for("ack", rid)[2]:
                self.engine.abort()

        self.busy = True
        try:
            return self.engine.stream(Feed(), params, on_group, max_inflight=max_inflight)  # type: ignore[arg-type]
        finally:
            self.busy = False

    def do_update_weights(self, _rid: int, flats: list[FlatBucket]) -> None:
        self.staged.extend(flats)  # held until the update ends: a decode step never sees half of it

    def do_finish_weight_update(self, _rid: int, *, version: int | None) -> None:
        staged, self.staged = self.staged, []
        for flat in staged:
            self.engine.update_weights(unflatten(flat))
        self.engine.finish_weight_update(version=version)


def _name_process(title: str) -> None:
    """Name the child in ps/top and /proc/<pid>/comm (15 bytes), so that it can be told from other helpers."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def serve(conn: Connection, model_path: str, name: str, num_threads: int, max_batch_size: int) -> None:
    """The child process: load the model, then serve the pipe until it closes or shutdown comes."""
    # Ctrl-C, SLURM's pre-timeout USR1 and preemption's TERM reach the whole process group: they
    # are the trainer's to handle (it saves, then stops us); we go when its pipe closes.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    _name_process(f"dapo-{name}")
    torch.set_num_threads(num_threads)
    from megatron_dapo.rollout.local.engine import LocalEngine

    try:
        engine = LocalEngine(model_path, name=name, max_batch_size=max_batch_size)
    except Exception as err:
        # Answer the parent's first call (its start-up health check) with the reason, then leave.
        with contextlib.suppress(EOFError, OSError):
            message = conn.recv()
            conn.send(("error", message[1], f"loading {model_path} failed: {type(err).__name__}: {err}"))
        return
    _Server(conn, engine).run()
