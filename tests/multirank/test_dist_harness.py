"""The multi-rank harness itself: forked from a preloaded forkserver, each rank still starts as a
spawned one would (the test's environment at the call, one thread, no process group yet)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from dist_utils import _FORKSERVER_PRELOAD, run_distributed

pytestmark = pytest.mark.multirank


def _probe(key: str) -> dict:
    return {"value": os.environ.get(key), "threads": torch.get_num_threads(),
            "initialized_before": torch.distributed.is_initialized(),
            "preloaded": sorted(m for m in _FORKSERVER_PRELOAD if m in sys.modules),
            "rank": os.environ["RANK"], "pid": os.getpid()}


def test_ranks_take_the_callers_environment_at_each_call(monkeypatch):
    monkeypatch.setenv("DIST_HARNESS_PROBE", "first")
    first = run_distributed(_probe, 2, "DIST_HARNESS_PROBE")
    monkeypatch.setenv("DIST_HARNESS_PROBE", "second")
    second = run_distributed(_probe, 2, "DIST_HARNESS_PROBE")
    assert [r["value"] for r in first] == ["first", "first"]
    assert [r["value"] for r in second] == ["second", "second"]
    assert [r["rank"] for r in second] == ["0", "1"]
    assert all(r["threads"] == 1 and not r["initialized_before"] for r in first + second)
    # Forked from the forkserver: megatron-core is already imported in every rank.
    assert all(r["preloaded"] == sorted(_FORKSERVER_PRELOAD) for r in first + second)
    assert len({r["pid"] for r in first + second}) == 4


def _all_reduce_rank() -> float:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return float(t.item())


def test_a_port_taken_between_its_pick_and_the_store_bind_is_picked_again(monkeypatch):
    """launcher.free_port binds, reads and closes: another process may take the port before rank
    0's store binds it (EADDRINUSE, two xdist workers). The harness picks another port."""
    import socket

    from megatron_dapo import launcher

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = [taken.getsockname()[1]]
    real = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda: picks.pop() if picks else real())
    try:
        assert run_distributed(_all_reduce_rank, 2) == [3.0, 3.0]
    finally:
        taken.close()
    assert picks == []  # the taken port was tried first
