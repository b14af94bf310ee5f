"""The restart channel of colocated SGLang servers (rollout/sglang/restarts.py) over one store.

The controller's request and the owner's thread meet in a store; here a HashStore in one
process (tests/multirank/test_rollout_colocated_restarts.py runs it over the job's TCP store).
"""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from megatron_dapo.rollout.engine import EngineError, EngineRestartsExhausted
from megatron_dapo.rollout.sglang.restarts import RestartChannel, RestartServer


def test_the_default_store_is_reachable_where_the_channel_looks_for_it():
    """job_store() uses torch's private accessor of init_process_group's store (torch 2.11, 2.13)."""
    assert callable(dist.distributed_c10d._get_default_store)
    assert callable(dist.PrefixStore)


def test_a_request_is_served_once_and_counted_and_the_budget_ends_it():
    channel = RestartChannel(dist.HashStore(), max_restarts=2, timeout_s=30, poll_s=0.01)
    served: list[str] = []
    server = RestartServer(channel, "sglang1", lambda: served.append(threading.current_thread().name))
    try:
        channel.request("sglang1")
        assert served == ["restart-sglang1"] and channel.count() == 1
        assert channel.take() and channel.count() == 2  # a restart at a resume takes from the same budget
        with pytest.raises(EngineRestartsExhausted, match=r"engine sglang1 failed after 2 restart\(s\).*"
                                                          r"max_engine_restarts=2\); its log: n1:/x.log"):
            channel.request("sglang1", log_location="n1:/x.log")
        assert served == ["restart-sglang1"] and channel.count() == 2
    finally:
        server.stop()


def test_a_failed_restart_is_reported_to_the_controller_and_an_unserved_one_times_out():
    channel = RestartChannel(dist.HashStore(), max_restarts=3, timeout_s=30, poll_s=0.01)

    def fail() -> None:
        raise RuntimeError("server exited with code 1")

    server = RestartServer(channel, "sglang0", fail)
    try:
        with pytest.raises(EngineError, match="sglang0: its restart failed: RuntimeError: server exited with code 1"):
            channel.request("sglang0")
    finally:
        server.stop()
    # Nobody owns sglang2 (a channel of its own, so a short timeout cannot race the served request).
    unserved = RestartChannel(dist.HashStore(), max_restarts=3, timeout_s=0.3, poll_s=0.01)
    with pytest.raises(EngineError, match="sglang2: its owner did not restart it within 0 s"):
        unserved.request("sglang2")


def test_a_client_shut_down_stops_waiting_for_its_owners_restart():
    """The run ends while the controller's stream waits for an owner's restart (up to the channel's
    half hour): the client's shutdown ends the wait at the next poll, and the stream's pool worker,
    joined at interpreter exit, with it."""
    channel = RestartChannel(dist.HashStore(), max_restarts=3, timeout_s=600, poll_s=0.01)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(EngineError, match=r"sglang3: shut down while its owner restarted it; its log: n1:/y\.log"):
        channel.request("sglang3", log_location="n1:/y.log", stop=stop)
