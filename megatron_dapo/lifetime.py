"""Helper processes die with the trainer process that started them, even after kill -9.

A trainer killed with SIGKILL (the OOM killer, `kill -9`, a node agent) runs no cleanup:
`daemon=True`, atexit and `finally` do nothing. Its helpers were re-parented to PID 1
and lived on: megatron-core's checkpoint writer starts a multiprocessing "spawn"
Manager (~270 MB) on the first save, the reward pool starts workers, and both keep the
multiprocessing resource tracker alive. They also hold the trainer's stdout, so
`megatron-dapo train ... | tee log` never returned.

Linux's PR_SET_PDEATHSIG makes the kernel send a signal to a process when its parent
dies. It must be set by the child itself (it is cleared in a forked child), so:

- every "spawn" child of a megatron-dapo process re-imports the parent's main module,
  which imports this package; `megatron_dapo/__init__.py` calls `die_with_parent()`
  there when the interpreter was started by multiprocessing (`--multiprocessing-fork`).
  That covers megatron-core's Manager and spawn-started reward workers;
- reward workers call it first thing (their parent is the forkserver, which itself exits
  when the trainer's end of its pipe closes);
- the resource tracker exits by itself once every process holding its pipe is gone.

Processes started with subprocess (SGLang servers) are handled in rollout/server_process.py.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def started_by_multiprocessing() -> bool:
    """True in an interpreter that multiprocessing's spawn start method launched."""
    return "--multiprocessing-fork" in getattr(sys, "orig_argv", ())


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent process exits.

    Returns:
        True if it is set; False off Linux or when prctl is unavailable.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:
        # The parent died between our start and the prctl: no signal will come.
        os.kill(os.getpid(), sig)
    return True
