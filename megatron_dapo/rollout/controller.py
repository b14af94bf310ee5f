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

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

from megatron_dapo.rollout.engine import GenerationResult, RolloutEngine, SamplingParams
from megatron_dapo.rollout.streaming import GroupCallback, PromptFeed, StreamingEngine, stream_per_prompt

__all__ = ["EngineThroughput", "RolloutController"]

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


class RolloutController:
    """Spreads generation over engines and fans out control calls to all of them."""

    def __init__(self, engines: Sequence[RolloutEngine]) -> None:
        """Own the engines and one waiting thread per engine.

        Args:
            engines: the rollout engines (at least one); their names should be unique.
        """
        if not engines:
            raise ValueError("RolloutController needs at least one engine; check rollout.engine and the GPU count")
        self.engines = list(engines)
        self.last_throughput: list[EngineThroughput] = []
        self._pool = ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="rollout")

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]:
        """Generate ``params.n`` responses per prompt on all engines concurrently.

        Args:
            prompts: token ids per prompt.
            params: sampling settings (the same for every engine).

        Returns:
            ``len(prompts) * n`` results, prompt-major, with global prompt indices 0..len-1.
            ``last_throughput`` then holds one entry per engine.
        """
        bounds = _split(len(prompts), len(self.engines))
        futures = [
            self._pool.submit(_timed_generate, engine, prompts[lo:hi], params, lo)
            for engine, (lo, hi) in zip(self.engines, bounds)
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

    def stream(
        self, feed: PromptFeed, params: SamplingParams, on_group: GroupCallback, *, max_inflight: int
    ) -> list[GenerationResult]:
        """Stream generation on all engines at once from one shared feed (rollout/streaming.py).

        Args:
            feed: the prompts; every engine takes from it whenever it has room.
            params: sampling settings (seeded per global prompt index, so a response's tokens do
                not depend on which engine took its prompt).
            on_group: receives each finished group, from the engine's thread; calls are serialised.
            max_inflight: prompts in flight per engine.

        Returns:
            The responses cut short by abort(), from every engine.
        """
        lock = threading.Lock()

        def serialised(group: list[GenerationResult]) -> None:
            with lock:
                on_group(group)

        def run(engine: RolloutEngine) -> list[GenerationResult]:
            if isinstance(engine, StreamingEngine):
                return engine.stream(feed, params, serialised, max_inflight=max_inflight)
            return stream_per_prompt(engine, feed, params, serialised, max_inflight=max_inflight)

        futures = [self._pool.submit(run, engine) for engine in self.engines]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f in done and f.exception() is not None), None)
        if failed is not None:
            feed.close()
            self._abort_all_quietly(skip=self.engines[futures.index(failed)])
            wait(futures)
            raise failed.exception()  # type: ignore[misc]
        return [r for f in futures for r in f.result()]

    def abort(self) -> None:
        """Abort in-flight generation on every engine."""
        for engine in self.engines:
            engine.abort()

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

    def shutdown(self) -> None:
        """Stop every engine, then the controller's threads."""
        try:
            self._broadcast("shutdown")
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

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
