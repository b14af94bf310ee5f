"""A testing hook: make one rank raise (or die) at the start of one phase of the RL step.

`MEGATRON_DAPO_FAULT=<phase>:<rank>` (phase one of `PHASES`, rank a global rank) makes
that rank raise `InjectedFault` at the start of that phase of the first step that reaches
it; `<phase>:<rank>:kill` makes it SIGKILL itself there instead (no cleanup runs: what a
kill -9 or the OOM killer leaves behind). It exists so the fault tests (tests/e2e/test_rank_faults.py) can check, on the real
code path, that a rank failing anywhere in a step ends every rank of the job within
seconds and that the job's error names the failing rank, instead of the others waiting
in a collective until the controller's timeout (hours). Unset, it costs one dict lookup
per phase. This module is the only place that reads the variable.
"""

from __future__ import annotations

import logging
import os

from megatron_dapo.errors import SharedUserError

logger = logging.getLogger(__name__)

FAULT_ENV = "MEGATRON_DAPO_FAULT"
PHASES = ("rollout", "dispatch", "update", "save", "fleet_init", "fleet_metadata", "broadcast", "fleet_finish")
"""rollout: before the controller generates (the other ranks are about to wait for it);
dispatch: before the batch is scattered over data-parallel ranks; update: before the first
optimizer step; save: inside the checkpoint save, after its temporary directory exists.
A fleet's weight sync (rollout/fleet/broadcast.py), on the controller (rank 0), in its order:
fleet_init: the servers asked to join the group, the controller not yet in it; fleet_metadata:
the servers sent the first bucket's names, dtypes and shapes (waiting in its broadcast), the
broadcast not begun; broadcast: its broadcast begun; fleet_finish: every bucket sent, the
servers asked to finish the update (set the version, resume). With one group per pipeline stage
(rollout/fleet/stages.py) `broadcast` is also reached on each stage's first rank, its broadcast of
its stage's first bucket begun."""


class InjectedFault(RuntimeError):
    """The failure MEGATRON_DAPO_FAULT asked for (a stand-in for any bug or crash in that phase)."""


def parse_fault(value: str) -> tuple[str, int] | None:
    """`"update:1"` -> ("update", 1); `"broadcast:0:kill"` -> ("broadcast", 0); "" -> None.

    Raises:
        SharedUserError: a malformed value (every rank reads the same launch environment).
    """
    if not value:
        return None
    phase, _, rest = value.partition(":")
    rank, _, action = rest.partition(":")
    if phase not in PHASES or not rank.isdigit() or action not in ("", "kill"):
        raise SharedUserError(f"{FAULT_ENV}={value!r} is not <phase>:<rank>[:kill] with phase in {', '.join(PHASES)} "
                              f"and rank a global rank, e.g. {FAULT_ENV}=update:1; unset it to train normally")
    return phase, int(rank)


def fault_point(phase: str, rank: int) -> None:
    """Raise InjectedFault if MEGATRON_DAPO_FAULT names this phase and this global rank.

    Args:
        phase: one of PHASES (the caller's position in the step).
        rank: this process' global rank.
    """
    assert phase in PHASES, phase
    value = os.environ.get(FAULT_ENV, "")
    if parse_fault(value) == (phase, rank):
        message = f"rank {rank}: injected fault at the start of {phase} ({FAULT_ENV}={value})"
        # Logged as it happens: the traceback prints only after this rank's cleanup, and the
        # fault tests time the other ranks' exit from this moment.
        logger.error("%s", message)
        if value.endswith(":kill"):
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), 9)
        raise InjectedFault(message)
