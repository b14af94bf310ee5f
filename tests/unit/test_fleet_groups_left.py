"""Servers leave the weight groups the fleet dropped (rollout/fleet/broadcast.py ``_leave_stale``).

A group lives on each server until the server destroys it (sglang 0.5.18 keeps every group it
joined, by name; on GPUs each is an NCCL communicator with its buffers). Before, a restart left one
on every survivor (the fleet's group, formed again with the new process) and one on the restarted
server (its reload's group of two). Here the groups are stand-ins (join_weight_group patched): what
is held is who is asked to leave which group, and when; the real servers' side is in
tests/sglang_cpu/test_sglang_fleet.py and tests/vllm_cpu/test_vllm_fleet.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_dapo.rollout.fleet import broadcast as fleet_broadcast
from megatron_dapo.rollout.fleet.broadcast import WeightBroadcast


class _Work:
    def wait(self) -> None:
        pass


class _Group:
    def broadcast(self, tensors, options) -> _Work:
        return _Work()

    def shutdown(self) -> None:
        pass


class _Server:
    tp_size = 1

    def __init__(self, name: str, *, join_fails: bool = False, leave_fails: bool = False) -> None:
        self.name, self.join_fails, self.leave_fails = name, join_fails, leave_fails
        self.joined: list[str] = []
        self.left: list[list[str]] = []

    def init_weight_update_group(self, *, group_name: str, **kwargs) -> None:
        if self.join_fails:
            raise RuntimeError("Failed to initialize custom process group")
        self.joined.append(group_name)

    def receive_distributed(self, bucket, **kwargs) -> None:
        pass

    def finish_weight_update(self, version=None) -> None:
        pass

    def leave_weight_update_groups(self, group_names) -> None:
        self.left.append(list(group_names))
        if self.leave_fails:
            raise RuntimeError("The group to be destroyed does not exist.")


@pytest.fixture(autouse=True)
def _stand_in_groups(monkeypatch):
    monkeypatch.setattr(fleet_broadcast, "join_weight_group", lambda **kwargs: _Group())


BUCKET = [("w", torch.zeros(4))]


def test_a_restart_makes_the_survivors_leave_the_old_group_before_the_new_one_forms() -> None:
    a, b, b2 = _Server("s0"), _Server("s1"), _Server("s1")
    fleet = WeightBroadcast([a, b], master_address="127.0.0.1", timeout_s=5)
    fleet.update_weights(BUCKET)
    fleet.finish_weight_update(1)
    fleet.update_weights(BUCKET)  # the same group: nobody leaves
    assert a.left == [] and len(a.joined) == 1
    old = a.joined[0]
    fleet.engine_replaced(1, b2)
    assert a.left == []  # left when the next group forms, not at the restart
    fleet.reload(1, [BUCKET], version=1)
    # The restarted server's reload group is left once it is loaded; its dead process is not asked.
    assert len(b2.joined) == 1 and b2.left == [[b2.joined[0]]] and b.left == []
    fleet.update_weights(BUCKET)
    assert a.left == [[old]] and a.joined[-1] != old and b2.left == [[b2.joined[0]]]
    assert a.joined[-1] == b2.joined[-1]
    fleet.close()  # at shutdown the servers are stopped next: nobody is asked
    assert a.left == [[old]] and len(b2.left) == 1


def test_every_stage_group_is_left_and_a_failed_join_is_not(caplog) -> None:
    a, b = _Server("s0"), _Server("s1", leave_fails=True)
    fleet = WeightBroadcast([a, b], master_address="127.0.0.1", timeout_s=5)
    assert fleet.prepare_stages(2) is not None
    fleet.form()
    first = list(a.joined)
    assert len(first) == 2  # the controller's group and stage 1's
    fleet.engine_replaced(0, a)  # the same server object (as a restart keeps it): the groups re-form
    with caplog.at_level(logging.WARNING):
        fleet.update_weights(BUCKET)
    assert a.left == [first] and b.left == [first]
    assert "s1 could not leave weight broadcast group(s)" in caplog.text and "does not exist" in caplog.text
    # A server whose join failed ends the forming in one line; it is not asked to leave what it never joined.
    c = _Server("s2", join_fails=True)
    fleet.engine_replaced(1, c)
    with pytest.raises(fleet_broadcast.FleetSyncError, match="s2"):
        fleet.update_weights(BUCKET)
    fleet.engine_replaced(1, b)
    fleet.update_weights(BUCKET)
    assert c.left == [] and a.left[-1] == [a.joined[-2]]
