"""Score a batch of responses in worker processes, with a timeout on every call.

Step 2 of the RL step (DESIGN.md) runs on the controller, next to torch and gloo
threads, and calls a reward function that may be a user's code. One slow or crashing
call must cost one sample, not the run: every call gets `timeout_s`, a call that raises,
times out or kills its worker scores -1.0 with acc False, and the batch's counts of
errors and timeouts are returned (and logged) so a broken reward shows in the metrics.

The workers (processes that load the function once, a deadline per call, replaced when
one hangs or dies) are rewards/workers.py's WorkerSet, which the custom tools share; this
module is the batch on top: which call goes to which worker, the scores of failed calls,
the counts and the circuit breaker. The pool is not thread-safe.
"""

import logging
import math
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_dapo.errors import UserError
from megatron_dapo.rewards.registry import RewardFn, get_reward_fn
from megatron_dapo.rewards.workers import WorkerSet, choose_start_method

logger = logging.getLogger(__name__)

# Score and accuracy of a call that raised, timed out or lost its worker (DAPO's "wrong").
FAILURE_SCORE = -1.0
# Longest response sent to a worker; answers sit at the end, so the tail is kept.
# 200k characters is about 50k tokens, over twice DAPO's 20480-token L_max.
DEFAULT_MAX_RESPONSE_CHARS = 200_000

RewardInput = tuple[str, str, dict | None] | tuple[str, str, dict | None, str | None]
"""(solution_str, ground_truth, extra_info[, data_source]): data_source reaches verl-style functions."""
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
        start_method = choose_start_method(start_method, "RewardPool")
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
        self._workers: WorkerSet | None = None
        self._closed = False
        if num_workers == 0:
            logger.warning(
                "RewardPool(%r) with num_workers=0 scores in-process: timeout_s=%s is not enforced",
                fn_spec,
                timeout_s,
            )
            return
        self._workers = WorkerSet(get_reward_fn, fn_spec, num_workers, label=f"reward function {fn_spec!r}",
                                  timeout_s=self.timeout_s, start_timeout_s=self.start_timeout_s,
                                  start_method=start_method, log_path=self.log_path, slow_hint="reward.timeout_s",
                                  process_name="reward-worker")

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def score_batch(self, batch: Sequence[RewardInput]) -> tuple[list[dict[str, Any]], RewardStats]:
        """Score every (solution_str, ground_truth, extra_info[, data_source]) of a batch.

        Args:
            batch: the responses with their reference answers, dataset extra_info and
                (optionally) data_source.

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
        for solution_str, ground_truth, extra_info, *data_source in batch:
            if isinstance(solution_str, str) and len(solution_str) > self.max_response_chars:
                solution_str = solution_str[-self.max_response_chars :]
                num_truncated += 1
            calls.append((solution_str, ground_truth, extra_info, data_source[0] if data_source else None))

        done = _Batch(len(calls))
        if self._workers is not None:
            try:
                self._score_in_workers(calls, done)
            except BaseException:
                # Calls still in flight would answer into the next batch: stop them all.
                self.close()
                raise
        else:
            for index, call in enumerate(calls):
                try:
                    done.results[index] = self._fn(*call)
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
        if self._workers is not None:
            self._workers.close()

    def _score_in_workers(self, calls: list[RewardInput], done: _Batch) -> None:
        """Hand calls to idle workers, one at a time each, until all have results."""
        assert self._workers is not None
        queue = deque(range(len(calls)))
        while queue or self._workers.running():
            for worker in self._workers.idle():
                if not queue:
                    break
                index = queue.popleft()
                if not self._workers.send(worker, index, calls[index]):
                    queue.appendleft(index)  # the worker died while idle; its replacement takes the call
            for outcome in self._workers.poll():
                if outcome.error is None:
                    done.results[outcome.task] = outcome.result
                else:
                    done.fail(outcome.task, outcome.error, timed_out=outcome.timed_out)
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


def probe_reward_fn(fn_spec: str, timeout_s: float, ground_truth: str, extra_info: dict[str, Any] | None = None,
                    data_source: str | None = None) -> None:
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
        _, stats = pool.score_batch([("", ground_truth, extra_info, data_source)])
    if stats.num_timeouts:
        raise UserError(f"reward function {fn_spec!r} did not return within reward.timeout_s={timeout_s:g} s on a "
                        f"probe call (an empty response against the answer {ground_truth[:40]!r}); fix the function "
                        "(it hangs) or raise reward.timeout_s if it is only slow")
