"""The controller's view of all rollout engines: one generate call, results in prompt order.

Step 1 of the RL step runs on global rank 0. :class:`RolloutController` splits the prompts
into contiguous, equal-count slices, one per engine, asks every engine at once (one
thread each: the engines do the work, the threads only wait on them), and concatenates the
answers back in prompt order. Each engine gets the global index of its first prompt, so
results carry global prompt indices and seeded sampling does not depend on the split.
If one engine fails, the others are aborted before the error is raised, so no engine is
left generating for a step that will not use its output. `stream` is the streaming variant:
every engine takes prompts from one shared feed and hands back groups as they finish.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any

from megatron_dapo.rollout.controller_sync import ControllerSync, WeightTransport
from megatron_dapo.rollout.engine import (
    EngineError,
    GenerationResult,
    RolloutEngine,
    SamplingParams,
    can_restart,
)
from megatron_dapo.rollout.fleet.broadcast import DaemonCalls
from megatron_dapo.rollout.streaming import (
    GroupCallback,
    ItemDriver,
    PromptFeed,
    StreamingEngine,
    TrackedFeed,
    Turns,
    stream_per_prompt,
)

__all__ = ["EngineThroughput", "RolloutController", "WeightTransport"]  # WeightTransport: controller_sync.py

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class EngineThroughput:
    """One engine's share of the last generate call."""

    engine: str
    """Engine name."""
    num_prompts: int
    """Prompts sent to it."""
    num_tokens: int
    """Tokens it generated (all responses)."""
    seconds: float
    """Wall time of its request."""

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second (0 when it had no work)."""
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


class RolloutController(ControllerSync):
    """Spreads generation over engines and fans out control calls to all of them."""

    def __init__(self, engines: Sequence[RolloutEngine], *, max_restarts: int = 0,
                 transport: WeightTransport | None = None) -> None:
        """Own the engines and one waiting thread per engine.

        Args:
            engines: the rollout engines (at least one); their names should be unique.
            max_restarts: how many times in all a dead or hung engine (a RestartableEngine)
                is replaced in place during this controller's life (rollout.max_engine_restarts);
                0 = an engine failure fails the call.
            transport: how weight buckets reach the engines when not each on its own: a fleet's
                broadcast (rollout/fleet/broadcast.py). A failed broadcast leaves every member's
                weights partly updated, so every engine is restarted (or the run stops).
        """
        if not engines:
            raise ValueError("RolloutController needs at least one engine; check rollout.engine and the GPU count")
        self.engines = list(engines)
        self.last_throughput: list[EngineThroughput] = []
        self._pool = ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="rollout")
        # Set by shutdown(): no engine is restarted after it, and one restarted meanwhile is stopped.
        self._closing = threading.Event()
        self._init_sync(max_restarts=max_restarts, transport=transport)
        # The session's abort (abort() until the next session starts): a driven item's next request
        # sees it even on an engine whose generate() starts unaborted (the local engines).
        self._session_aborted = threading.Event()
        self._streaming_feed: PromptFeed | None = None  # the running stream's feed, closed by abort()
        self._turn_locks: dict[int, threading.Lock] = {}
        self._turn_locks_guard = threading.Lock()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]:
        """Generate ``params.n`` responses per prompt on all engines concurrently.

        Args:
            prompts: token ids per prompt.
            params: sampling settings (the same for every engine).

        Returns:
            ``len(prompts) * n`` results, prompt-major, with global prompt indices 0..len-1.
            ``last_throughput`` then holds one entry per engine.
        """
        self.restart_failed_engines()
        self._clear_aborts()
        bounds = _split(len(prompts), len(self.engines))
        futures = [
            self._pool.submit(self._generate_restarting, i, prompts[lo:hi], params, lo)
            for i, (lo, hi) in enumerate(bounds)
        ]
        # Wait for the first failure, not in engine order: a dead engine must stop the others now,
        # not after they have finished generating for a step that will be thrown away.
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f in done and f.exception() is not None), None)
        if failed is not None:
            # Not the failed engine: its generate is over on our side, and one that stopped
            # answering would hold each abort attempt for the control timeout.
            self._abort_all_quietly(skip=self.engines[futures.index(failed)])
            wait(futures)
            raise failed.exception()
        results: list[GenerationResult] = []
        throughput: list[EngineThroughput] = []
        for engine, (lo, hi), future in zip(self.engines, bounds, futures):
            engine_results, seconds = future.result()
            results.extend(engine_results)
            throughput.append(
                EngineThroughput(
                    engine=engine.name,
                    num_prompts=hi - lo,
                    num_tokens=sum(len(r.output_ids) for r in engine_results),
                    seconds=seconds,
                )
            )
        self.last_throughput = throughput
        return results

    def _generate_restarting(self, index: int, prompts: Sequence[Sequence[int]], params: SamplingParams,
                             offset: int) -> tuple[list[GenerationResult], float]:
        """One engine's slice; a restartable engine that dies is replaced and asked again (same seeds)."""
        while True:
            life = self._lives[index]
            try:
                return _timed_generate(self.engines[index], prompts, params, offset)
            except EngineError as err:
                if not can_restart(self.engines[index]):
                    raise
                self._restart(index, err, life=life)

    def stream(
        self, feed: PromptFeed, params: SamplingParams, on_group: GroupCallback, *, max_inflight: int,
        drive: ItemDriver | None = None,
    ) -> list[GenerationResult]:
        """Stream generation on all engines at once from one shared feed (rollout/streaming.py).

        Args:
            feed: the prompts; every engine takes from it whenever it has room.
            params: sampling settings (seeded per global prompt index, so a response's tokens do
                not depend on which engine took its prompt).
            on_group: receives each finished group, from the engine's thread; calls are serialised.
            max_inflight: prompts in flight per engine.
            drive: each prompt's group over several requests (multi-turn episodes): every engine
                then streams request by request (`stream_per_prompt`), `max_inflight` items at
                once; an engine that is not safe to call from several threads (one with its own
                streaming loop: the local engines) runs one request at a time while the other
                items wait for it or for their tools.

        Returns:
            The responses cut short by abort(), from every engine.
        """
        lock = threading.Lock()

        def serialised(group: list[GenerationResult]) -> None:
            with lock:
                on_group(group)

        def run_once(engine: RolloutEngine, engine_feed: Any, done: Callable[[list[GenerationResult]], None]
                     ) -> list[GenerationResult]:
            if drive is not None:
                return stream_per_prompt(engine, engine_feed, params, done, max_inflight=max_inflight,
                                         generate_item=lambda e, item, p: drive(self._turns(e, item.index), item, p,
                                                                                self._session_aborted.is_set),
                                         abort_asked=self._session_aborted.is_set)
            if isinstance(engine, StreamingEngine):
                return engine.stream(engine_feed, params, done, max_inflight=max_inflight)
            return stream_per_prompt(engine, engine_feed, params, done, max_inflight=max_inflight,
                                     abort_asked=self._session_aborted.is_set)

        def run(index: int) -> list[GenerationResult]:
            while True:
                engine, life = self.engines[index], self._lives[index]
                if not can_restart(engine):
                    return run_once(engine, feed, serialised)
                # What this engine took and has not handed back: sent again if it dies.
                tracked = TrackedFeed(feed)

                def done(group: list[GenerationResult], tracked: TrackedFeed = tracked) -> None:
                    tracked.finished(group[0].prompt_index)
                    serialised(group)

                try:
                    return run_once(engine, tracked, done)
                except EngineError as err:
                    # Its prompts go to the other engines while it restarts (a minute for a server):
                    # held until then, they kept the feed's gate shut and the fleet idle.
                    feed.requeue(tracked.in_flight())
                    self._restart(index, err, life=life)

        self.restart_failed_engines()
        self._clear_aborts()
        self._streaming_feed = feed
        futures = [self._pool.submit(run, i) for i in range(len(self.engines))]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f in done and f.exception() is not None), None)
        if failed is not None:
            feed.close()
            self._abort_all_quietly(skip=self.engines[futures.index(failed)])
            wait(futures)
            raise failed.exception()  # type: ignore[misc]
        return [r for f in futures for r in f.result()]

    def abort(self) -> None:
        """Abort in-flight generation on every engine, and every request sent after it in this session.

        A dead engine has nothing to abort and its own thread reports (or restarts) it: its error
        here is not raised. The producer aborts from whichever engine's thread filled the batch, so
        a raise would charge a live engine with another's death (seen: a fleet of two, one killed,
        and the survivor restarted too).
        """
        self._session_aborted.set()
        # Nothing more is taken from a running stream's feed either: a request sent after the abort
        # ends at once as aborted, its prompt stays in flight, and once the collector's gate counts
        # enough of them every engine's thread waits on the gate for good (seen: a SLURM fleet run
        # whose trainer failed stopped its producer by abort, which never ended, nor did the process).
        feed = self._streaming_feed
        if feed is not None:
            feed.close()
        for engine in self.engines:
            try:
                engine.abort()
            except EngineError as err:
                logger.info("abort: engine %s did not take it (%s)", engine.name, str(err).splitlines()[0][:200])

    def _clear_aborts(self) -> None:
        """A generate or stream session starts: an abort of the last one no longer stops requests."""
        self._session_aborted.clear()
        self._streaming_feed = None  # the last stream's (a stream sets its own after this)
        for engine in self.engines:
            engine.clear_abort()

    def _turns(self, engine: RolloutEngine, offset: int) -> Turns:
        """`engine`'s generate for one driven feed item (ItemDriver): results indexed from 0,
        seeds at the item's global index; after the session's abort, requests end at once with
        reason abort and no tokens. Engines with their own streaming loop take one request at a time."""
        with self._turn_locks_guard:
            lock = self._turn_locks.setdefault(id(engine), threading.Lock()) if isinstance(engine, StreamingEngine) \
                else None

        def turns(prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]:
            with lock or contextlib.nullcontext():
                if self._session_aborted.is_set():
                    return [GenerationResult(prompt_index=i, sample_index=j, output_ids=[], logprobs=[],
                                             finish_reason="abort") for i in range(len(prompts)) for j in range(params.n)]
                results = engine.generate(prompts, params, index_offset=offset)
            return [replace(r, prompt_index=r.prompt_index - offset) for r in results]

        return turns

    def _abort_all_quietly(self, skip: RolloutEngine | None = None) -> None:
        """Abort every engine but `skip`, logging (not raising) failures: a dead engine cannot abort."""
        for engine in self.engines:
            if engine is skip:
                continue
            try:
                engine.abort()
            except Exception as err:  # the original failure is the one to report
                logger.warning("abort of engine %s failed: %s", engine.name, err)

    def release_memory(self) -> None:
        """Release every engine's accelerator memory before training."""
        self._broadcast("release_memory")

    def resume_memory(self) -> None:
        """Take the memory back on every engine after training."""
        self._broadcast("resume_memory")

    def health(self) -> dict[str, bool]:
        """Health of every engine, by name."""
        return {engine.name: engine.health() for engine in self.engines}

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """Stop every engine, then the controller's threads.

        Never on the controller's pools: a stream that did not stop (its engine relaunching for a
        minute, a request to a server that stopped answering) holds their workers, and a stop
        queued behind it waited for it (seen 2026-11-29: a SLURM fleet job that failed at step 4
        never exited). Each engine is stopped on a thread of its own, which also ends what the
        stream was waiting for; no engine is restarted after this.
        """
        self._closing.set()
        try:
            if self._transport is not None:
                self._transport.close()
            calls = DaemonCalls()
            stops = [calls.submit(engine.shutdown) for engine in self.engines]
            _, late = wait(stops, timeout=timeout_s)
            for engine, stop in zip(self.engines, stops):
                if stop in late:
                    logger.warning("engine %s did not stop within %.0f s; leaving it to its reaper", engine.name,
                                   timeout_s)
            failed = next((stop.exception() for stop in stops if stop not in late and stop.exception()), None)
            if failed is not None:  # raised after every engine had its turn
                raise failed
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._update_pool.shutdown(wait=False, cancel_futures=True)

    def _broadcast(self, method: str) -> None:
        futures = [self._pool.submit(getattr(engine, method)) for engine in self.engines]
        for future in futures:
            future.result()


def _split(num_prompts: int, num_engines: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) slices whose sizes differ by at most one."""
    base, extra = divmod(num_prompts, num_engines)
    bounds, lo = [], 0
    for e in range(num_engines):
        hi = lo + base + (1 if e < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _timed_generate(
    engine: RolloutEngine, prompts: Sequence[Sequence[int]], params: SamplingParams, index_offset: int
) -> tuple[list[GenerationResult], float]:
    if not prompts:
        return [], 0.0
    start = time.perf_counter()
    results = engine.generate(prompts, params, index_offset=index_offset)
    return results, time.perf_counter() - start
