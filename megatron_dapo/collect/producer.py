"""Asynchronous rollout: the batch of step t+1 is generated while the actor trains step t.

With `rollout.placement: disaggregated` the engines do not share the actor's devices, so
they need not wait for it. A `RolloutProducer` thread on the controller collects the
batches of the coming steps (collect.batch.collect_batch, streaming dynamic sampling and
overlong shaping unchanged) while the trainer's thread updates the actor and syncs the
weights; the engines load each new version between two decode steps and go on.

Versions and the bound. Version v is the weights after the update of step v (the run's
start, or its resume step, is version `start_step`). Step t trains version t-1 on its
batch; a response whose oldest token was sampled under version v is `(t-1) - v` versions
stale. The producer starts collecting the batch of step t only once version
t-1-max_staleness has reached the engines, and versions only grow, so every token of that
batch, carried partial rollouts aside (refused with max_staleness > 0), is at most
max_staleness versions stale: the producer waits instead. max_staleness 0 is the
synchronous loop (each batch starts after the previous update). The trainer checks the
bound on every batch it takes (`check_staleness`).

Checkpoints and resume. A checkpoint after step t records the sampler and collection
state from before the batch of step t+1 was drawn (`resume_state_after`), so a run killed
at any point, -9 included, resumes at step t+1 and regenerates that batch from the same
prompts under version t. Rollouts in flight or queued at the kill are lost work, never a
lost or repeated step or prompt.

Evaluation of version t (trainer.test_freq) runs on this thread too, once version t has
reached the engines and before the batch of step t+2 starts (t+1 with max_staleness 0);
the trainer waits for the result before it moves the weights on, so the held-out numbers
measure exactly the weights of step t, as in the synchronous loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_dapo.collect.types import Group

__all__ = ["ProducedBatch", "RolloutProducer", "StalenessError", "check_staleness", "staleness_metrics"]

logger = logging.getLogger(__name__)


class StalenessError(RuntimeError):
    """A batch holds a response older than trainer.max_staleness allows (a bug, never a user error)."""


@dataclass(kw_only=True, slots=True)
class ProducedBatch:
    """One step's batch, with what the producer knew when it started collecting it."""

    step: int
    """The step that trains on it."""
    groups: list[Group]
    """train_batch_size groups with advantages."""
    metrics: dict[str, float]
    """collect_batch's metrics, plus timing_s/engine_idle."""
    start_version: int
    """The engines' weight version when collection started."""


class RolloutProducer:
    """The controller's rollout thread of the asynchronous loop."""

    def __init__(
        self, *, first_step: int, last_step: int, max_staleness: int, start_version: int,
        collect: Callable[[int], tuple[list[Group], dict[str, float]]],
        snapshot: Callable[[], dict[str, Any]],
        validate: Callable[[], dict[str, float]] | None = None,
        validate_versions: frozenset[int] = frozenset(),
    ) -> None:
        """Args:
            first_step, last_step: the steps to collect for (inclusive).
            max_staleness: trainer.max_staleness (>= 0).
            start_version: the version the engines hold now (the start or resume step).
            collect: collects the batch of a step (collect_batch over the run's engines).
            snapshot: the sampler and collection state now (for resume_state_after).
            validate: evaluates the engines' current weights on the held-out prompts.
            validate_versions: the versions to evaluate (trainer.test_freq, val_before_train).
        """
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0")
        self.max_staleness = max_staleness
        self._first, self._last = first_step, last_step
        self._collect, self._snapshot, self._validate = collect, snapshot, validate
        self._pending_validations = set(validate_versions) if validate is not None else set()
        self._changed = threading.Condition()
        self._version = start_version
        self._batches: dict[int, ProducedBatch] = {}
        self._validations: dict[int, dict[str, float]] = {}
        self._started: dict[int, dict[str, Any]] = {}  # step -> resume state before its draws
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def start(self) -> RolloutProducer:
        self._thread.start()
        return self

    # ------------------------------------------------------------------ the trainer's side

    def batch_for(self, step: int) -> ProducedBatch:
        """The batch of `step`, waiting for it (the actor's idle time)."""
        with self._changed:
            while step not in self._batches:
                self._raise_if_failed()
                self._changed.wait()
            return self._batches.pop(step)

    def weights_synced(self, version: int) -> None:
        """The engines hold `version` now (called after each update's weight sync)."""
        with self._changed:
            self._version = version
            self._changed.notify_all()

    def validation(self, version: int) -> dict[str, float]:
        """The held-out metrics of `version`, waiting for them."""
        with self._changed:
            while version not in self._validations:
                self._raise_if_failed()
                self._changed.wait()
            return self._validations.pop(version)

    def resume_state_after(self, step: int) -> dict[str, Any]:
        """What a checkpoint after `step` must record to resume at step + 1 without loss or repeat."""
        with self._changed:
            started = self._started.get(step + 1)
            # Not started yet: the producer cannot start it while we hold the lock.
            return started if started is not None else self._snapshot()

    def stop(self) -> None:
        """Stop after the current collection (which the caller may abort on the engines)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the producer's thread

    def _run(self) -> None:
        try:
            for step in range(self._first, self._last + 1):
                # Evaluations first: the trainer waits for them before it moves the weights on.
                # With a bound, the batch of step v+1 is generated before version v is
                # evaluated, while the actor trains; without one, before the batch of v+1.
                idle = self._validate_due(step - 1 - min(self.max_staleness, 1))
                waited = self._wait_for_version(step - 1 - self.max_staleness)
                if idle < 0 or waited < 0:
                    return
                idle += waited
                with self._changed:
                    self._started[step] = self._snapshot()
                    for passed in [s for s in self._started if s <= self._version]:  # trained already
                        del self._started[passed]
                    start_version = self._version
                groups, metrics = self._collect(step)
                metrics["timing_s/engine_idle"] = idle
                with self._changed:
                    self._batches[step] = ProducedBatch(step=step, groups=groups, metrics=metrics,
                                                        start_version=start_version)
                    self._changed.notify_all()
            self._validate_due(self._last)
        except BaseException as err:
            with self._changed:
                if not self._stopping:
                    self._error = err
                self._changed.notify_all()

    def _validate_due(self, up_to: int) -> float:
        """Evaluate every wanted version <= `up_to` not evaluated yet, each once it reached the
        engines (the trainer holds the weights there until it has the result); the seconds
        waited (-1 = stopping)."""
        waited = 0.0
        for version in sorted(v for v in self._pending_validations if v <= up_to):
            wait = self._wait_for_version(version)
            if wait < 0:
                return wait
            waited += wait
            assert self._validate is not None
            result = self._validate()
            with self._changed:
                self._pending_validations.discard(version)
                self._validations[version] = result
                self._changed.notify_all()
        return waited

    def _wait_for_version(self, version: int) -> float:
        """Block until the engines hold at least `version`; the seconds waited (-1 = stopping)."""
        start = time.perf_counter()
        with self._changed:
            while self._version < version and not self._stopping:
                self._changed.wait()
            return -1.0 if self._stopping else time.perf_counter() - start

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            # The error itself (train.py maps DynamicSamplingError, EngineError, ... to exit codes).
            self._error.add_note("(raised on the rollout thread, collecting ahead of the trainer)")
            raise self._error
        if not self._thread.is_alive() and not self._stopping:
            raise RuntimeError("the rollout thread ended without producing the batch asked for")


def check_staleness(groups: list[Group], step: int, max_staleness: int) -> None:
    """Raise if a response of step `step`'s batch is older than the bound allows."""
    oldest_allowed = step - 1 - max_staleness
    for group in groups:
        for sample in group.samples:
            if sample.weight_versions and sample.weight_versions[0] < oldest_allowed:
                raise StalenessError(
                    f"step {step}: a response sampled under weight version {sample.weight_versions[0]} is "
                    f"{step - 1 - sample.weight_versions[0]} versions stale, over trainer.max_staleness={max_staleness}")


def staleness_metrics(groups: list[Group], step: int, max_staleness: int) -> dict[str, float]:
    """The batch's staleness: mean, max, histogram (share of responses per age) and version spans.

    A response's staleness is the age of its oldest token: (step - 1) - its first version.
    """
    ages = [step - 1 - s.weight_versions[0] for g in groups for s in g.samples if s.weight_versions]
    if not ages:
        return {}
    metrics = {"async/staleness_mean": sum(ages) / len(ages), "async/staleness_max": float(max(ages))}
    for age in range(max_staleness + 1):
        metrics[f"async/staleness_hist/{age}"] = sum(a == age for a in ages) / len(ages)
    spans = [len(s.weight_versions) for g in groups for s in g.samples if s.weight_versions]
    metrics["async/responses_spanning_versions"] = sum(n > 1 for n in spans) / len(spans)
    return metrics
