"""The fault-injection hook (faults.py) and which errors a rank treats as an echo of a peer's exit."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_dapo.errors import UserError, lost_peer
from megatron_dapo.faults import FAULT_ENV, InjectedFault, fault_point, parse_fault
from megatron_dapo.rollout.engine import EngineError


def test_the_fault_fires_only_on_its_phase_and_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "update:1")
    fault_point("update", 0)
    fault_point("save", 1)
    with pytest.raises(InjectedFault, match=r"^rank 1: injected fault at the start of update \(MEGATRON_DAPO_FAULT=update:1\)$"):
        fault_point("update", 1)
    monkeypatch.delenv(FAULT_ENV)
    fault_point("update", 1)


@pytest.mark.parametrize("value", ["update", "train:1", "update:-1", "update:one", ":1", "update:1:die"])
def test_a_malformed_fault_is_one_user_error_line(value: str) -> None:
    with pytest.raises(UserError, match=rf"^{FAULT_ENV}='{value}' is not <phase>:<rank>\[:kill\] with phase in "
                                        "rollout, dispatch, update, save, fleet_init, fleet_metadata, broadcast, "
                                        "fleet_finish"):
        parse_fault(value)


def test_a_kill_fault_kills_its_process_without_cleanup() -> None:
    """`<phase>:<rank>:kill` is a kill -9 at that point (the fleet tests' trainer killed mid-broadcast)."""
    import os
    import subprocess
    import sys

    assert parse_fault("broadcast:0:kill") == ("broadcast", 0)
    code = ("import atexit; from megatron_dapo.faults import fault_point; atexit.register(print, 'cleanup ran'); "
            "fault_point('broadcast', 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, FAULT_ENV: "broadcast:0:kill"})
    assert done.returncode == -9 and "cleanup ran" not in done.stdout
    assert "rank 0: injected fault at the start of broadcast" in done.stderr


def test_only_torch_distributed_errors_are_a_lost_peer() -> None:
    gloo = "[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:12193."
    assert lost_peer(RuntimeError(gloo))
    assert lost_peer(dist.DistBackendError("NCCL error: remote process exited or there was a network error"))
    # The controller's own failure quoting a reset connection is the root cause, not an echo.
    assert not lost_peer(EngineError("SGLang engine sglang1: POST /generate failed: [Errno 104] Connection reset by peer"))
    assert not lost_peer(RuntimeError("CUDA out of memory"))
