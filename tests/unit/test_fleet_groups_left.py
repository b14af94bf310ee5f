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


class _Process:
    def check_alive(self) -> None:
        pass


class _Server:
    tp_size = 1

    def __init__(self, name: str, *, join_fails: bool = False, leave_fails: bool = False) -> None:
        self.name, self.join_fails, self.leave_fails = name, join_fails, leave_fails
        self.process = _Process()  # its server process (a restart replaces it)
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
    """A restart replaces the server's process in place (the same engine object, engine.restart): the
    fresh process holds none of the old groups and is not asked to leave them (SGLang answers
    "The group to be destroyed does not exist")."""
    a, b = _Server("s0"), _Server("s1")
    fleet = WeightBroadcast([a, b], master_address="127.0.0.1", timeout_s=5)
    fleet.update_weights(BUCKET)
    fleet.finish_weight_update(1)
    fleet.update_weights(BUCKET)  # the same group: nobody leaves
    assert a.left == [] and len(a.joined) == 1
    old = a.joined[0]
    b.process = _Process()  # restarted in place
    fleet.engine_replaced(1, b)
    assert a.left == []  # left when the next group forms, not at the restart
    fleet.reload(1, [BUCKET], version=1)
    # The restarted server's reload group is left once it is loaded.
    reload_group = b.joined[-1]
    assert b.left == [[reload_group]]
    fleet.update_weights(BUCKET)
    assert a.left == [[old]] and a.joined[-1] != old and b.left == [[reload_group]]
    assert a.joined[-1] == b.joined[-1]
    fleet.close()  # at shutdown the servers are stopped next: nobody is asked
    assert a.left == [[old]] and len(b.left) == 1


def test_a_left_group_is_out_of_torchs_registry() -> None:
    """destroy_weight_group (the vLLM workers' leave): group.shutdown() alone frees nothing of a gloo
    group, and torch's destroy_process_group needs the ranks join_weight_group records."""
    from torch.distributed.distributed_c10d import _world

    from megatron_dapo.launcher import free_port
    from megatron_dapo.rollout.fleet.group import destroy_weight_group, join_weight_group

    group = join_weight_group(master_address="127.0.0.1", master_port=free_port("127.0.0.1"), world_size=1, rank=0,
                              group_name="left-test", timeout_s=30)
    group.broadcast([torch.zeros(4)], torch.distributed.BroadcastOptions()).wait()
    assert group in _world.pg_map and _world.pg_group_ranks[group] == {0: 0}
    destroy_weight_group(group)
    assert group not in _world.pg_map and group not in _world.pg_backend_config and group not in _world.pg_to_tag


def test_every_stage_group_is_left_and_a_failed_join_is_not(caplog) -> None:
    a, b = _Server("s0"), _Server("s1", leave_fails=True)
    fleet = WeightBroadcast([a, b], master_address="127.0.0.1", timeout_s=5)
    assert fleet.prepare_stages(2) is not None
    fleet.form()
    first = list(a.joined)
    assert len(first) == 2  # the controller's group and stage 1's
    fleet.engine_replaced(0, a)  # the same server, not restarted: the groups re-form
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


def test_the_controllers_dropped_groups_leave_torchs_registry(monkeypatch) -> None:
    """The controller's own side of a dropped group is destroyed, not only shut down: before, each
    restart left one gloo group (its sockets and threads) in torch's registry for the run's life.
    Real one-member gloo groups stand in for the fleet's (the fake servers join nothing)."""
    from torch.distributed.distributed_c10d import _world

    from megatron_dapo.launcher import free_port
    from megatron_dapo.rollout.fleet.group import join_weight_group

    made = []

    def one_member_group(*, group_name: str, **kwargs):
        made.append(join_weight_group(master_address="127.0.0.1", master_port=free_port("127.0.0.1"), world_size=1,
                                      rank=0, group_name=group_name, timeout_s=30))
        return made[-1]

    monkeypatch.setattr(fleet_broadcast, "join_weight_group", one_member_group)
    a, b = _Server("s0"), _Server("s1")
    fleet = WeightBroadcast([a, b], master_address="127.0.0.1", timeout_s=5)
    fleet.update_weights(BUCKET)
    first = made[0]
    assert first in _world.pg_map
    b.process = _Process()
    fleet.engine_replaced(1, b)  # a restart
    assert first not in _world.pg_map and first not in _world.pg_group_ranks
    fleet.update_weights(BUCKET)
    assert len(made) == 2 and made[1] in _world.pg_map
    fleet.close()
    assert made[1] not in _world.pg_map


def test_a_failed_forming_is_formed_again_under_a_fresh_name(monkeypatch) -> None:
    """A forming that failed at the rendezvous drops what it made: the next one takes a new name and
    port (the failed rendezvous may still hold its port) and the servers leave the failed name."""
    ports = []
    calls = {"n": 0}

    def join_once_failing(*, master_port: int, **kwargs) -> _Group:
        ports.append(master_port)
        calls["n"] += 1
        if calls["n"] == 1:
            raise TimeoutError("rendezvous: 1 of 3 ranks joined")
        return _Group()

    monkeypatch.setattr(fleet_broadcast, "join_weight_group", join_once_failing)
    a, b = _Server("s0"), _Server("s1")
    fleet = WeightBroadcast([a, b], master_address="127.0.0.1", timeout_s=5)
    with pytest.raises(fleet_broadcast.FleetSyncError, match="forming the weight broadcast group"):
        fleet.form()
    failed = a.joined[0]
    fleet.form()
    assert a.joined[-1] != failed and b.joined[-1] == a.joined[-1]
    assert ports[0] != ports[1]
    assert a.left == [[failed]] and b.left == [[failed]]
