"""Restarting the colocated SGLang servers of a job that the controller does not own.

In a colocated job each server belongs to its engine's leader rank (colocated.py): only
that rank can kill and relaunch the process, and only the ranks' colocated sync has the
weights. The controller (global rank 0) generates on every engine through HTTP clients.
While it generates, the other ranks are waiting in the step's dispatch collective, so a
restart cannot be a collective. The controller and the owners meet in the job's TCP store
(torch.distributed's default store, under a prefix of its own):

- The controller's client of a failed engine asks for a restart: it adds 1 to the
  engine's request counter and polls for the answer to that request
  (:meth:`RestartChannel.request`).
- A thread on the leader rank (:class:`RestartServer`) polls the counters of the engines
  it owns. It kills what is left of the server, launches it again with the same resolved
  settings (port, key and log, appended), and loads the weights of the last sync, from a
  host copy the leader keeps, with their version. Then it answers.
- Every restart takes one unit of the job's budget, a counter in the same store. That
  covers the restarts asked for here and those a leader does at a resume, when it finds
  its server dead (ColocatedEngines.resume_memory). rollout.max_engine_restarts is the
  budget for the whole job, and a leader refuses a restart beyond it.

The store is only polled, never waited on: a TCPStore client serializes its calls, and a
blocking wait would hold up the rank's other users of the store (group creation).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from megatron_dapo.rollout.engine import EngineError, EngineRestartsExhausted

__all__ = ["RestartChannel", "RestartServer", "job_store"]

logger = logging.getLogger(__name__)

PREFIX = "megatron_dapo/engine_restarts/"
BUDGET_KEY = "taken"


def job_store() -> dist.Store:
    """This job's TCP store under our prefix: every rank reaches the same keys.

    torch.distributed keeps the store of init_process_group as the default group's store;
    ``distributed_c10d._get_default_store`` (torch 2.11 and 2.13, the versions we run) is how
    its own helpers reach it. tests/unit/test_rollout_sglang_restarts.py pins it.
    """
    return dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())


class RestartChannel:
    """The controller's requests and the owners' answers, over one store."""

    def __init__(self, store: dist.Store, *, max_restarts: int, timeout_s: float = 1800.0,
                 poll_s: float = 0.2) -> None:
        """
        Args:
            store: shared by every rank (:func:`job_store`; a HashStore in one-process tests).
            max_restarts: rollout.max_engine_restarts, for the whole job.
            timeout_s: how long the controller waits for an owner's answer (its server's
                start-up and the weight load).
            poll_s: how often both sides look at the store.
        """
        self.store = store
        self.max_restarts = max_restarts
        self.timeout_s = timeout_s
        self.poll_s = poll_s

    # ------------------------------------------------------------------ budget

    def take(self) -> bool:
        """Take one restart from the job's budget; False once it is spent."""
        return int(self.store.add(BUDGET_KEY, 1)) <= self.max_restarts

    def count(self) -> int:
        """Restarts taken so far in the job (refused attempts are not counted)."""
        return min(int(self.store.add(BUDGET_KEY, 0)), self.max_restarts)

    # ------------------------------------------------------------------ controller side

    def request(self, name: str, *, log_location: str = "", stop: threading.Event | None = None) -> None:
        """Ask the owner of engine `name` to restart it; return once it serves again.

        Args:
            stop: once set (the client's shutdown: the run ends), stop waiting for the answer.

        Raises:
            EngineRestartsExhausted: the job's budget is spent.
            EngineError: the restart failed, no answer came within ``timeout_s``, or `stop` was set.
        """
        number = int(self.store.add(f"{name}/requested", 1))
        key = f"{name}/answer/{number}"
        where = f"; its log: {log_location}" if log_location else ""
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([key]):
            if stop is not None and stop.is_set():
                raise EngineError(f"SGLang engine {name}: shut down while its owner restarted it{where}")
            if time.monotonic() > deadline:
                raise EngineError(f"SGLang engine {name}: its owner did not restart it within {self.timeout_s:.0f} s"
                                  f"{where}")
            time.sleep(self.poll_s)
        answer = json.loads(self.store.get(key))
        if answer["status"] == "exhausted":
            raise EngineRestartsExhausted(
                f"engine {name} failed after {self.max_restarts} restart(s) of engines in this run "
                f"(rollout.max_engine_restarts={self.max_restarts}){where}; the run stops here: rerun the same "
                "command to resume from the last checkpoint, and look at the engine's log for why it died")
        if answer["status"] != "ok":
            raise EngineError(f"SGLang engine {name}: its restart failed: {answer['error']}{where}")

    # ------------------------------------------------------------------ owner side

    def pending(self, name: str) -> int:
        """How many restarts of `name` have been asked for so far."""
        return int(self.store.add(f"{name}/requested", 0))

    def answer(self, name: str, numbers: range, status: str, error: str = "") -> None:
        """Answer requests `numbers` of engine `name` ("ok", "exhausted" or "failed")."""
        text = json.dumps({"status": status, "error": error})
        for number in numbers:
            self.store.set(f"{name}/answer/{number}", text)


class RestartServer:
    """The leader's thread that serves restart requests for the engine it owns."""

    def __init__(self, channel: RestartChannel, name: str, restart: Callable[[], None]) -> None:
        """
        Args:
            channel: the job's channel.
            name: the engine this rank owns.
            restart: kills and relaunches the server and loads the current weights
                (ColocatedEngines.restart_owned); raises on failure.
        """
        self.channel = channel
        self.name = name
        self._restart = restart
        self._handled = channel.pending(name)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"restart-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.channel.poll_s):
            try:
                asked = self.channel.pending(self.name)
            except Exception:  # the store went away: the job is ending
                return
            if asked > self._handled:
                # Requests that queued up while one was served are answered by the same restart.
                numbers = range(self._handled + 1, asked + 1)
                self.channel.answer(self.name, numbers, *self.serve())
                self._handled = asked

    def serve(self) -> tuple[str, str]:
        """One restart within the budget: ("ok", ""), ("exhausted", ...) or ("failed", why)."""
        if not self.channel.take():
            logger.error("engine %s: restart asked for, but rollout.max_engine_restarts=%d are spent",
                         self.name, self.channel.max_restarts)
            return "exhausted", "rollout.max_engine_restarts is spent"
        logger.warning("engine %s: restarting its server in place for the controller (restart %d of at most %d)",
                       self.name, self.channel.count(), self.channel.max_restarts)
        try:
            self._restart()
        except Exception as err:
            logger.error("engine %s: restart failed: %s", self.name, err)
            return "failed", f"{type(err).__name__}: {err}"
        return "ok", ""

    def stop(self, *, wait: bool = True) -> None:
        """End the thread (idempotent): it serves no further request; with `wait`, a restart under
        way finishes first (its engine's shutdown ends a relaunch at once: ColocatedEngines.shutdown)."""
        self._stop.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join(timeout=60.0)
