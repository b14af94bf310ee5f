"""A fleet sync that breaks on NCCL aborts its group; it never waits for the broadcast in flight.

Since torch 2.5 ``ProcessGroupNCCL::shutdown()`` (what ``destroy_process_group`` calls) finalizes the
communicator and waits for its kernels; only ``abort()`` cancels them (DESIGN.md, "Rules where the
device, the backend or the launcher matters": "NCCL weight groups are aborted"). A server dead
mid-broadcast therefore hung the controller in the drop, before the sync could say who failed. NCCL
cannot run here: the groups are stand-ins that record how they were ended, and a broadcast that
ends only when the group is aborted (as NCCL's does with a member gone). The CUDA half, a real
one-rank NCCL group with a kernel queued ahead of its broadcast, is tests/gpu/test_weight_group_nccl.py.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from megatron_dapo.rollout.fleet import broadcast as fleet_broadcast
from megatron_dapo.rollout.fleet import group as fleet_group
from megatron_dapo.rollout.fleet.broadcast import FleetSyncError, WeightBroadcast
from megatron_dapo.rollout.fleet.stages import StageSender


class _Work:
    def __init__(self, released: threading.Event | None) -> None:
        self.released = released

    def wait(self) -> None:
        if self.released is not None:  # an NCCL broadcast a member never joins: only an abort ends it
            self.released.wait()


class _NcclGroup:
    """Records how it was ended; its broadcasts hang until abort() when ``hangs``."""

    def __init__(self, hangs: bool = False) -> None:
        self.hangs = hangs
        self.ended: list[str] = []
        self._aborted = threading.Event()

    def broadcast(self, tensors, options) -> _Work:
        return _Work(self._aborted if self.hangs else None)

    def abort(self) -> None:
        self.ended.append("abort")
        self._aborted.set()

    def shutdown(self) -> None:  # NCCL's graceful shutdown: waits for the kernels in flight
        self.ended.append("shutdown")
        if self.hangs:
            self._aborted.wait(timeout=30)


class _Server:
    tp_size = 1

    def __init__(self, name: str, *, receive_fails_after: float | None = None) -> None:
        self.name = name
        self.receive_fails_after = receive_fails_after
        self.process = None

    def init_weight_update_group(self, **kwargs) -> None:
        pass

    def receive_distributed(self, bucket, **kwargs) -> None:
        if self.receive_fails_after is not None:
            time.sleep(self.receive_fails_after)
            raise RuntimeError(f"{self.name}: connection reset (the server died mid-broadcast)")

    def finish_weight_update(self, version=None) -> None:
        pass

    def leave_weight_update_groups(self, group_names) -> None:
        pass

    def health(self) -> bool:
        return True


BUCKET = [("w", torch.zeros(4))]


def test_a_server_dying_mid_broadcast_aborts_the_nccl_group_and_names_the_server(monkeypatch) -> None:
    """The fleet's broken-group path on NCCL: the broadcast hangs (a member is gone), the server's
    request fails, the controller aborts the group (never a shutdown, which would wait for the
    broadcast) and raises FleetSyncError naming the server, well before the sync's deadline."""
    made: list[_NcclGroup] = []

    def join(**kwargs) -> _NcclGroup:
        made.append(_NcclGroup(hangs=True))
        return made[-1]

    monkeypatch.setattr(fleet_broadcast, "join_weight_group", join)
    fleet = WeightBroadcast([_Server("s0"), _Server("s1", receive_fails_after=0.2)], master_address="127.0.0.1",
                            backend="nccl", timeout_s=60, device="cpu")
    fleet.exit_grace_s = 0.0
    start = time.monotonic()
    with pytest.raises(FleetSyncError, match="s1"):
        fleet.update_weights(BUCKET)
    assert time.monotonic() - start < 30  # the deadline is 60 s; a shutdown-first drop waited 30 here
    assert made[0].ended == ["abort"]


def test_every_dropped_nccl_group_is_aborted_and_gloo_ones_destroyed(monkeypatch) -> None:
    """A restart's drop (no broadcast in flight) aborts on NCCL too: an idle communicator aborts at
    once, and the drop never depends on whether a broadcast is still queued."""
    made: list[_NcclGroup] = []
    monkeypatch.setattr(fleet_broadcast, "join_weight_group", lambda **kwargs: made.append(_NcclGroup()) or made[-1])
    servers = [_Server("s0"), _Server("s1")]
    fleet = WeightBroadcast(servers, master_address="127.0.0.1", backend="nccl", timeout_s=5, device="cpu")
    fleet.update_weights(BUCKET)
    fleet.engine_replaced(1, servers[1])
    assert made[0].ended == ["abort"]
    fleet.update_weights(BUCKET)
    fleet.close()
    assert made[1].ended == ["abort"]


def test_a_stage_source_aborts_its_nccl_group_and_keeps_a_gloo_one_to_its_deadline() -> None:
    sender = StageSender()
    sender.group, sender.backend = _NcclGroup(hangs=True), "nccl"
    group = sender.group
    thread = sender.broadcast(torch.zeros(4, dtype=torch.uint8), stage=1)
    sender.abandon()
    thread.join(timeout=5)
    assert not thread.is_alive() and group.ended == ["abort"]
    sender.group, sender.backend = _NcclGroup(), "nccl"
    dropped = sender.group
    sender.drop()
    assert dropped.ended == ["abort"]


def test_abort_weight_group_takes_a_registered_group_out_of_torchs_registry() -> None:
    """The abort path on a real registered group (gloo here: its abort is a no-op in torch 2.13, the
    registry's part is what is held): nothing of it stays in torch's registries."""
    from torch.distributed.distributed_c10d import _world

    from megatron_dapo.launcher import free_port

    group = fleet_group.join_weight_group(master_address="127.0.0.1", master_port=free_port("127.0.0.1"),
                                          world_size=1, rank=0, group_name="abort-test", timeout_s=30)
    group.broadcast([torch.zeros(4)], torch.distributed.BroadcastOptions()).wait()
    fleet_group.abort_weight_group(group)
    for registry in (_world.pg_map, _world.pg_names, _world.pg_group_ranks, _world.pg_backend_config):
        assert group not in registry


def test_an_nccl_groups_collectives_outlast_the_controllers_watch(monkeypatch) -> None:
    """The jobs run with TORCH_NCCL_ASYNC_ERROR_HANDLING=3: a collective past the group's timeout
    kills the process. The controller's watch aborts at timeout_s, so the group's own timeout must
    be later, or the watchdog could end the trainer before FleetSyncError is raised."""
    seen: dict[str, timedelta] = {}
    import torch.distributed.distributed_c10d as c10d

    real = c10d._new_process_group_helper

    def helper(*args, timeout, backend_options=None, **kwargs):  # torch 2.13's option name
        seen[str(args[3])] = timeout
        if str(args[3]) == "nccl":  # no NCCL on CPU: the timeout it would get is what is held
            return _NcclGroup(), None
        return real(*args, timeout=timeout, backend_options=backend_options, **kwargs)

    monkeypatch.setattr(c10d, "_new_process_group_helper", helper)
    from megatron_dapo.launcher import free_port

    group = fleet_group.join_weight_group(master_address="127.0.0.1", master_port=free_port("127.0.0.1"),
                                          world_size=1, rank=0, group_name="timeout-test", timeout_s=30)
    fleet_group.destroy_weight_group(group)
    nccl = fleet_group.join_weight_group(master_address="127.0.0.1", master_port=free_port("127.0.0.1"),
                                         world_size=1, rank=0, group_name="timeout-test-nccl", backend="nccl",
                                         timeout_s=30)
    fleet_group.destroy_weight_group(nccl, backend="nccl")
    assert nccl.ended == ["abort"] and nccl not in c10d._world.pg_group_ranks
    assert seen["nccl"] == timedelta(seconds=30 + fleet_group.NCCL_TIMEOUT_HEADROOM_S)
    assert seen["gloo"] == timedelta(seconds=30)  # gloo's deadline is the one the controller reports
    assert fleet_group.collective_timeout_s(600, "nccl") >= 600 + 60
    assert fleet_group.collective_timeout_s(600, "gloo") == 600
    # The jobs that set the watchdog to kill are the ones this headroom is for.
    sbatch = (Path(__file__).parents[2] / "slurm" / "dapo.sbatch").read_text()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}" in sbatch
