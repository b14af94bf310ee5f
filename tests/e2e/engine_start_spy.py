"""`python engine_start_spy.py RECORD CONFIG [overrides]`: the trainer, with what exists when engines start recorded.

The record (JSON lines, in order) names each event of the build: the resume's checkpoint load,
the ranks' engine launch (colocated SGLang) and the controller's engines (every engine family
builds its clients there), each with the bytes of the actor's optimizer state at that moment.
tests/e2e/test_engine_start_order.py reads it (issue 57: SGLang sizes its memory at its start).
"""

from __future__ import annotations

import json
import sys

from megatron_dapo import run as run_module
from megatron_dapo import train
from megatron_dapo.actor.optimizer_state import optimizer_state_bytes

RECORD = sys.argv.pop(1)
_runs: list = []


def _note(event: str) -> None:
    actor = _runs[-1].actor if _runs else None
    with open(RECORD, "a") as f:
        f.write(json.dumps({"event": event,
                            "optimizer_state_bytes": optimizer_state_bytes(actor.optimizer) if actor else None}) + "\n")


def _wrap(owner, name: str, event: str, *, keep_run: bool = False) -> None:
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        if keep_run:
            _runs.append(args[0])
        else:
            _note(event)
        return real(*args, **kwargs)

    setattr(owner, name, spy)


_wrap(run_module, "_start_engines_and_resume", "", keep_run=True)
_wrap(run_module, "launch_rank_engines", "launch_rank_engines")
_wrap(run_module, "_build_controller", "build_controller")
_wrap(run_module.CheckpointManager, "load", "checkpoint_load")

if __name__ == "__main__":
    sys.argv[0] = "megatron_dapo.train"
    sys.exit(train.main())
