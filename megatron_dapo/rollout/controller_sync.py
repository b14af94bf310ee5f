"""The controller's side of step 7 and of replacing a dead engine (RolloutController's half).

A sync arrives in pieces (buckets, a finish; under pipeline parallelism each stage's buckets in
turn, fleet/stages.py) and reaches every engine: each on its own (``_each_engine``: a failed
engine is marked and skipped, the others go on) or through a fleet's transport (``_fleet_call``:
a failed broadcast leaves every member partly updated, so all are marked and stopped at once).
The last finished sync's weights are kept on the host for a restart (kept_weights.py).

A marked or dead engine is replaced in place, with the kept weights, before its next use:
a generation's start, a stream's thread that meets it dead, or the next sync, which restarts
what is still marked before its export (``restart_failed_engines``; docs/DESIGN.md, "A fleet of
SGLang servers"). One death is one restart and one unit of ``rollout.max_engine_restarts``:
restarts run one at a time under the weights lock, each naming the life it replaces
(``_lives``); a second caller for a life already replaced does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from megatron_dapo.rollout.engine import EngineError, EngineRestartsExhausted, RolloutEngine, can_restart
from megatron_dapo.rollout.kept_weights import KeptWeights

__all__ = ["ControllerSync", "WeightTransport"]

logger = logging.getLogger("megatron_dapo.rollout.controller")  # one logger for the controller's two halves


class WeightTransport(Protocol):
    """Step 7 for all engines at once (a fleet's broadcast) instead of each engine on its own."""

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None: ...

    def finish_weight_update(self, version: int | None = None) -> None: ...

    def engine_replaced(self, index: int, engine: RolloutEngine) -> None: ...

    def reload(self, index: int, buckets: Sequence[Sequence[tuple[str, torch.Tensor]]],
               version: int | None) -> None: ...

    def close(self) -> None: ...

    # With pipeline stages (fleet/stages.py): each stage's first rank broadcasts its own buckets.

    def prepare_stages(self, stages: int) -> Any: ...

    def form(self) -> None: ...

    def receive_stage(self, stage: int, header: Sequence[tuple[str, str, list[int]]]
                      ) -> list[tuple[str, torch.Tensor]]: ...


class ControllerSync:
    """Weights, failures and restarts of RolloutController's engines (mixed into it)."""

    engines: list[RolloutEngine]
    _closing: threading.Event

    def _init_sync(self, *, max_restarts: int, transport: WeightTransport | None) -> None:
        self.max_restarts = max_restarts
        self.num_restarts = 0
        """Engines replaced so far (logged as rollout/engine_restarts)."""
        # Weight updates arrive while the engines stream (the asynchronous loop): their own threads.
        self._update_pool = ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="rollout-update")
        # What a restarted engine loads, and the sync a restart waits for (kept_weights.py).
        self._kept = KeptWeights(keep=max_restarts > 0 and any(can_restart(e) for e in self.engines))
        self._restart_lock = threading.Lock()
        self._failed: set[int] = set()  # engines whose update failed: restarted before their next use or sync
        # Each engine's restarts so far: one death is one restart, whichever threads meet it (a
        # stream's, a sync's start); a restart asked for a life already replaced does nothing.
        self._lives = [0] * len(self.engines)
        self._transport = transport

    # ------------------------------------------------------------------ weights (RolloutEngine for sync_weights)

    @property
    def name(self) -> str:
        return "controller"

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Step 7 for every engine at once; the bucket is also kept for restarts (sync_weights calls this)."""
        with self._kept.lock:
            self.begin_weight_update()
            self._kept.add(bucket)
            if self._transport is not None:
                self._fleet_call(lambda: self._transport.update_weights(bucket))  # type: ignore[union-attr]
            else:
                self._each_engine(lambda engine: engine.update_weights(bucket))

    # ------------------------------------------------------------------ a fleet's per-stage sync (fleet/stages.py)

    @property
    def weights_lock(self) -> threading.RLock:
        """Held through a sync, a restart waits for it to end."""
        return self._kept.lock

    @property
    def keeps_weights(self) -> bool:
        """Whether the last sync's weights are kept on the host for a restarted engine."""
        return self._kept.keep

    def begin_weight_update(self) -> None:
        """A piece of a sync arrives. At a sync's first piece, the engines an earlier failed sync marked
        and no generation has restarted since are restarted first (with the kept weights): while one
        is marked a fleet's sync sends nothing (``_fleet_call``), so its live members would go on
        serving older weights, labelled so, past the staleness bound once the producer runs ahead
        (seen 2026-12-04: a kill in a vLLM fleet's broadcast while a stream ran; the stream restarted
        the killed server only, and the next sync skipped the fleet)."""
        with self._kept.lock:
            if not self._kept.syncing:
                self.restart_failed_engines()
            self._kept.begin()

    @property
    def sync_failed(self) -> bool:
        """A broadcast failed: every engine is restarted before its next use, this sync sends no more."""
        return bool(self._failed)

    def prepare_stage_groups(self, stages: int) -> Any:
        """The groups the pipeline stages' first ranks join this sync, or None (see WeightBroadcast.prepare_stages)."""
        return self._transport.prepare_stages(stages)  # type: ignore[union-attr]

    def form_weight_groups(self) -> bool:
        """Form the fleet's groups with every server; False when that failed (the failure is handled
        as a failed broadcast's: every engine restarted before its next use, or raised)."""
        with self._kept.lock:
            self.begin_weight_update()
            self._fleet_call(self._transport.form)  # type: ignore[union-attr]
            return not self._failed

    def receive_stage_weights(self, stage: int, header: Sequence[tuple[str, str, list[int]]]) -> bool:
        """Every server and the controller receive pipeline stage ``stage``'s bucket from its first rank;
        the controller keeps it for restarts. False when the broadcast failed (nothing kept)."""
        with self._kept.lock:
            self.begin_weight_update()
            received: list[list[tuple[str, torch.Tensor]]] = []
            self._fleet_call(lambda: received.append(self._transport.receive_stage(stage, header)))  # type: ignore[union-attr]
            if received:  # the controller's own buffer (on its GPU for a GPU fleet)
                self._kept.add(received[0], copy=False)
            return bool(received)

    def keep_weights_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """A bucket of this sync that reached the controller alone (the broadcast had failed): kept for restarts."""
        with self._kept.lock:
            self._kept.add(bucket, copy=False)

    def finish_weight_update(self, version: int | None = None) -> None:
        """End the update on every engine; the kept buckets become the weights a restart loads."""
        with self._kept.lock:
            if self._transport is not None:
                self._fleet_call(lambda: self._transport.finish_weight_update(version))  # type: ignore[union-attr]
            else:
                self._each_engine(lambda engine: engine.finish_weight_update(version=version))
            self._kept.finish(version)

    def load_adapter(self, directory: str, version: int) -> None:
        """An adapter-only sync (rollout.lora_sync=adapter): every engine serves the PEFT adapter in
        ``directory`` from now on; kept for an engine restarted later (on the base it starts from)."""
        with self._kept.lock:
            self.begin_weight_update()
            self._each_engine(lambda engine: engine.load_adapter(directory, version))  # type: ignore[attr-defined]
            self._kept.adapter = (directory, version)
            self._kept.finish(version)

    def _each_engine(self, call: Callable[[RolloutEngine], None]) -> None:
        """Run `call` on every engine concurrently. An engine that fails it and can be restarted is
        marked and replaced before its next generation (with the kept weights, this sync's
        included); any other failure is raised."""
        futures = [self._update_pool.submit(call, engine) for i, engine in enumerate(self.engines)
                   if i not in self._failed]
        live = [i for i in range(len(self.engines)) if i not in self._failed]
        for i, future in zip(live, futures):
            try:
                future.result()
            except EngineError as err:
                if not self._can_restart(self.engines[i]):
                    raise
                logger.warning("engine %s failed during a weight update (%s); it is restarted before its next use",
                               self.engines[i].name, err)
                self._failed.add(i)

    def _fleet_call(self, call: Callable[[], None]) -> None:
        """One step of a fleet's broadcast sync. After a failure every engine holds partly
        updated weights: all are marked, restarted with the kept weights before their next use
        (the rest of this sync is kept, not sent), or, where that is not possible, it is raised."""
        if self._failed:
            return
        try:
            call()
        except EngineError as err:
            if not all(self._can_restart(e) for e in self.engines):
                raise
            logger.warning("the fleet's weight broadcast failed (%s); every engine is stopped now and restarted "
                           "with the current weights before its next use", err)
            self._failed.update(range(len(self.engines)))
            # The survivors are paused mid-update with partly loaded weights: a running stream's
            # requests to them would wait for their timeout (an hour), so their servers go now;
            # the stream's threads meet a dead engine, hand its prompts to the others and restart
            # it (seen: a vLLM fleet hung after a member died during a broadcast). All at once: a
            # server's stop may wait for its teardown (server_process.KILLED_EXIT_S).
            stops = [threading.Thread(target=_stop_quietly, args=(e,), name=f"stop-{e.name}", daemon=True)
                     for e in self.engines]
            for thread in stops:
                thread.start()
            for thread in stops:
                thread.join()

    def _can_restart(self, engine: RolloutEngine) -> bool:
        return can_restart(engine) and self.max_restarts > 0

    def _restart(self, index: int, err: BaseException, *, life: int) -> None:
        """Replace engine `index` by a fresh one holding the current weights, or raise the final error.

        ``life``: the engine's restart count when the caller met `err` (``_lives``). Restarts run one
        at a time, under the weights lock and never inside a sync, and each checks the life first:
        of the callers that meet one death (a stream's thread, a sync's start) the first restarts
        the engine and spends a unit of the budget, the others find the life replaced and return,
        and their callers go on with the fresh engine. A restart that fails leaves the life as it
        was: the next caller tries again, and spends another unit."""
        engine = self.engines[index]
        log = getattr(engine, "log_path", None)
        where = f"; its log: {log}" if log else ""
        with self._kept.lock:
            self._kept.wait_for_sync(self._closing)  # never inside a sync (kept_weights.py says why)
            with self._restart_lock:
                if self._lives[index] != life:
                    return
                self._refuse_when_closing(engine, err)
                if not self._can_restart(engine) or self.num_restarts >= self.max_restarts:
                    raise EngineRestartsExhausted(
                        f"engine {engine.name} failed ({err}) after {self.num_restarts} restart(s) of engines in this "
                        f"run (rollout.max_engine_restarts={self.max_restarts}){where}; the run stops here: rerun the "
                        "same command to resume from the last checkpoint, and look at the engine's log for why it died"
                    ) from err
                self.num_restarts += 1
                logger.warning("engine %s failed (%s): restarting it in place, restart %d of at most %d%s",
                               engine.name, err, self.num_restarts, self.max_restarts, where)
            self._replace(index, err)

    def _replace(self, index: int, err: BaseException) -> None:
        """The restart itself (``_restart``'s, under the weights lock)."""
        engine = self.engines[index]
        engine.restart()  # type: ignore[attr-defined]
        if self._closing.is_set():  # shutdown() ran during the relaunch: the fresh server goes too
            with contextlib.suppress(Exception):
                engine.shutdown()
            raise EngineError(f"engine {engine.name}: the rollout was shut down while it restarted") from err
        if self._transport is not None:
            self._transport.engine_replaced(index, engine)
            if self._kept.buckets:  # the way a fleet's weights travel, to this server alone
                self._transport.reload(index, self._kept.buckets, self._kept.version)
        elif self._kept.buckets:
            for bucket in self._kept.buckets:
                engine.update_weights(bucket)
            engine.finish_weight_update(version=self._kept.version)
        if self._kept.adapter is not None:  # its base is the checkpoint it starts from
            engine.load_adapter(*self._kept.adapter)  # type: ignore[attr-defined]
        with self._restart_lock:  # together: restart_failed_engines reads both under this lock
            self._failed.discard(index)
            self._lives[index] += 1

    def _refuse_when_closing(self, engine: RolloutEngine, err: BaseException) -> None:
        if self._closing.is_set():
            raise EngineError(f"engine {engine.name} failed ({err}) while the rollout was being shut down; "
                              "not restarted") from err

    def restart_failed_engines(self) -> None:
        """Restart now every engine a failed sync left marked (with the kept weights), one after another.

        The trainer calls it on the controller before a sync's export, while the other ranks wait
        in a gloo group (run.py): a restart inside the export would hold them in its collectives,
        whose deadline is short (trainer.collective_timeout_minutes)."""
        for index in sorted(self._failed):
            with self._restart_lock:
                marked, life = index in self._failed, self._lives[index]
            if marked:  # not restarted by another thread meanwhile
                self._restart(index, EngineError(f"engine {self.engines[index].name}: its weight update failed"),
                              life=life)


def _stop_quietly(engine: RolloutEngine) -> None:
    with contextlib.suppress(Exception):  # already dead, or stopping anyway
        engine.shutdown()
