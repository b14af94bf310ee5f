"""Who a failed fleet sync names: the one line a FleetSyncError carries.

A sync fails for every member at once (a dead server breaks the group for all), so most members
echo someone else's failure. The line names, in order of evidence: the servers whose process
exited, those that did not answer within the deadline, those whose request failed for a reason of
their own; and, when every failure is a lost peer in another rank's broadcast, that rank (a
pipeline stage's first rank, fleet/stages.py) rather than the servers that echo it
(tests/unit/test_fleet_blame.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from megatron_dapo.errors import lost_peer, lost_peer_marker
from megatron_dapo.rollout.engine import EngineError

__all__ = ["FleetSyncError", "alive", "blame"]


class FleetSyncError(EngineError):
    """A broadcast sync failed; ``engines`` names the servers that died or did not answer."""

    def __init__(self, message: str, engines: Sequence[str]) -> None:
        super().__init__(message)
        self.engines = tuple(engines)


def blame(what: str, futures: dict[Future, Any], engines: Sequence[Any], *, timeout_s: float,
          cause: BaseException | None = None, source: str | None = None, exit_grace_s: float = 10.0
          ) -> FleetSyncError:
    """The error of a sync that failed at ``what``.

    Args:
        futures: each server's request of this step -> that server (``name``, ``process``).
        engines: the whole fleet (a dead server is named even when its request was not this step's).
        timeout_s: the deadline the servers had (rollout.fleet_sync_timeout_s), quoted in the line.
        cause: the controller's own failure, if it had one.
        source: the rank that broadcast, when not the controller ("pipeline stage 1's first rank").
        exit_grace_s: how long a server whose worker died may take to exit before the source is blamed.
    """
    failed = [(e.name, f.exception()) for f, e in futures.items() if f.done() and f.exception() is not None]
    silent = [e.name for f, e in futures.items() if not f.done()]
    dead = [e.name for e in engines if not alive(e)]
    named = list(dict.fromkeys([*dead, *silent, *(n for n, _ in failed)]))
    echoes = [lost_peer_marker(str(cause))] if cause is not None and lost_peer(cause) else []
    echoes += [m for _, e in failed if (m := lost_peer_marker(str(e))) is not None]
    if source is not None and not dead and not silent and echoes and len(echoes) == len(failed) + (cause is not None):
        # Another rank's broadcast, every server answering, every failure (the controller's own
        # receive, the servers' answers) a lost peer: the member gone is the source, unless a
        # server's worker died, whose main process may stay up a few seconds more (SGLang ends
        # about 5 s after a child): given that long, a server that exits is named instead.
        dead = _dead_within(engines, exit_grace_s)
        if not dead:
            # Every server is named: each may hold a partly updated model.
            return FleetSyncError(f"weight broadcast to the fleet failed at {what}: {source} is gone (the "
                                  f"broadcast's other members saw \"{echoes[0]}\")", [e.name for e in engines])
        named = list(dict.fromkeys([*dead, *named]))
    parts = []
    if dead:
        parts.append(f"{', '.join(dead)} died")
    if silent:
        parts.append(f"{', '.join(silent)} did not answer within {timeout_s:g} s")
    if failed and not dead:
        parts.append("; ".join(f"{n}: {str(e).splitlines()[0][:300]}" for n, e in failed[:2]))
    if cause is not None and (silent or not parts):  # its own side failed (or it waited in vain)
        parts.append(f"{type(cause).__name__}: {str(cause).splitlines()[0][:300] if str(cause) else ''}")
    return FleetSyncError(f"weight broadcast to the fleet failed at {what}: {'; '.join(parts)} "
                          f"(rollout.fleet_sync_timeout_s={timeout_s:g})", named or [e.name for e in engines])


def _dead_within(engines: Sequence[Any], grace_s: float) -> list[str]:
    """The servers whose process has exited, waiting up to grace_s for the first to."""
    deadline = time.monotonic() + grace_s
    while True:
        dead = [e.name for e in engines if not alive(e)]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.2)


def alive(engine: Any) -> bool:
    """Whether a server's process still runs (one without a process of ours counts as alive)."""
    process = getattr(engine, "process", None)
    if process is None:
        return True
    try:
        process.check_alive()
    except EngineError:
        return False
    return True
