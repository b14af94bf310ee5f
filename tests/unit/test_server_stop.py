"""ServerProcess.stop ends a server that ignores SIGTERM and removes its key file and /dev/shm
leftovers, however long the kernel takes to tear the SIGKILLed process down.

Seen 2026-12-04 (AMD EPYC, 2 cores, six training runs beside the suite): after an SGLang fleet's
run, both servers' key files (`sglang<i>.secret.yaml`) stayed in engine_logs/. stop() waited the
grace (2 s) after its SIGKILL too, the teardown took longer, the wait's TimeoutExpired left stop()
before the files were removed. A SIGKILL is not refused: stop() now waits for its end
(KILLED_EXIT_S) and removes the files. The slow teardown is simulated on a real process that
ignores SIGTERM: its wait() answers only a second after the SIGKILL.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from megatron_dapo.rollout.server_process import KILLED_EXIT_S, ServerProcess

TEARDOWN_S = 1.0
"""How long after its SIGKILL the simulated server is gone (longer than the grace below)."""


def test_a_server_slow_to_go_after_its_sigkill_is_waited_for_and_its_files_removed(tmp_path: Path,
                                                                                     monkeypatch: pytest.MonkeyPatch):
    key = tmp_path / "srv.secret.yaml"
    key.write_text("api-key: not-a-real-one\n")
    ready = tmp_path / "trapped"
    proc = ServerProcess(["/bin/sh", "-c", f"trap '' TERM; touch {ready}; sleep 600 & wait"], name="srv",
                         log_path=tmp_path / "srv.log", private_files=(key,))
    deadline = time.monotonic() + 30
    while not ready.exists():  # the trap is set (a SIGTERM before it would end the shell at once)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    killed_at: list[float] = []
    real_killpg, real_wait = os.killpg, proc._popen.wait

    def killpg(pgid: int, sig: int) -> None:
        real_killpg(pgid, sig)
        if sig == 9 and not killed_at:
            killed_at.append(time.monotonic())

    def wait(timeout: float | None = None) -> int:
        if killed_at:  # gone TEARDOWN_S after its SIGKILL, not before
            gone = killed_at[0] + TEARDOWN_S
            if timeout is not None and time.monotonic() + timeout < gone:
                time.sleep(timeout)
                raise subprocess.TimeoutExpired("srv", timeout)
            time.sleep(max(0.0, gone - time.monotonic()))
        return real_wait(timeout=timeout)

    monkeypatch.setattr(os, "killpg", killpg)
    monkeypatch.setattr(proc._popen, "wait", wait)
    grace = 0.5
    assert grace < TEARDOWN_S < KILLED_EXIT_S
    proc.stop(timeout_s=grace)
    assert killed_at, "the server ignored its SIGTERM: stop() had to SIGKILL it"
    assert proc.returncode is not None
    assert not key.exists(), "the key file outlived the server"
