"""Helper processes die with a SIGKILLed parent (megatron_dapo/lifetime.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The parent imports megatron_dapo as the trainer does; the helper processes are the ones a
# run starts: megatron-core's spawn Manager (its checkpoint writer's result queue) and the
# reward pool's forkserver workers.
PARENT = """
import multiprocessing as mp, os, sys, time
import megatron_dapo
from megatron_dapo.rewards.pool import RewardPool

if __name__ == "__main__":
    manager = mp.get_context("spawn").Manager()
    pool = RewardPool("reward_fns_for_tests:half", num_workers=2, timeout_s=30)
    pids = [manager._process.pid] + [w.process.pid for w in pool._workers]
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_helpers_die_within_10s_of_a_kill_9_of_their_parent(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "unit"), str(REPO)]),
           "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    try:
        line = parent.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3, line
        assert all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)  # the parent only, as the OOM killer does
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        assert [p for p in pids if _alive(p)] == []
    finally:
        # What survived a failing test: its own session, so only this test's processes.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
