"""A fleet's weight group on NCCL is destroyed for good, and the next one forms (DESIGN.md "GPU fleets").

The controller drops its group at every engine restart (rollout/fleet/broadcast.py `_drop_group`)
and destroys it with `destroy_weight_group`: on NCCL that shuts the communicator down and takes the
group out of torch's registry. Held on CPU with gloo (tests/unit/test_fleet_groups_left.py); here
the NCCL half, with a group of one rank (one GPU cannot hold two ranks of one communicator).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_an_nccl_weight_group_is_destroyed_and_the_next_one_broadcasts() -> None:
    from torch.distributed.distributed_c10d import _world

    from megatron_dapo.launcher import free_port
    from megatron_dapo.rollout.fleet.group import destroy_weight_group, join_weight_group, on_device

    def form(name: str):
        return join_weight_group(master_address="127.0.0.1", master_port=free_port("127.0.0.1"), world_size=1,
                                 rank=0, group_name=name, backend="nccl", timeout_s=60)

    flat = torch.arange(1024, dtype=torch.uint8, device="cuda")
    first = form("nccl-weights-a")
    with on_device(flat):
        first.broadcast([flat], torch.distributed.BroadcastOptions()).wait()
    destroy_weight_group(first)
    assert first not in _world.pg_map and first not in _world.pg_group_ranks
    second = form("nccl-weights-b")  # a restart's re-formed group, in the same process
    with on_device(flat):
        second.broadcast([flat], torch.distributed.BroadcastOptions()).wait()
    torch.cuda.synchronize()
    assert torch.equal(flat.cpu(), torch.arange(1024, dtype=torch.uint8))
    destroy_weight_group(second)
    assert second not in _world.pg_map


def test_dropping_an_nccl_group_with_a_broadcast_in_flight_returns_at_once_and_the_trainer_runs_on() -> None:
    """The fleet's broken-group path on CUDA (DESIGN.md "NCCL weight groups are aborted"): a kernel
    of ~10 s sits ahead of the broadcast on the sync's own stream (the stand-in for a member that
    never joins), the broadcast is waited on a daemon thread as the fleet does, then the group is
    dropped. The drop must return well before the kernel ends (an abort: torch >= 2.5's graceful
    shutdown would wait for it), and a kernel on the default stream, where the trainer computes,
    must run meanwhile (the broadcast is not waited on there)."""
    import threading
    import time

    from megatron_dapo.launcher import free_port
    from megatron_dapo.rollout.fleet.group import (
        broadcast_bytes,
        destroy_weight_group,
        join_weight_group,
        side_stream,
    )

    group = join_weight_group(master_address="127.0.0.1", master_port=free_port("127.0.0.1"), world_size=1, rank=0,
                              group_name="nccl-abort-in-flight", backend="nccl", timeout_s=60)
    flat = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
    broadcast_bytes(group, flat, None)  # the communicator exists before the timed part
    torch.cuda.synchronize()
    streams: dict = {}
    stream = side_stream(flat, streams)
    start = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        torch.cuda._sleep(int(10 * 1.98e9))  # ~10 s at H100/H200 clocks
    sender = threading.Thread(target=broadcast_bytes, args=(group, flat, stream), daemon=True)
    sender.start()
    sender.join(timeout=30)
    t0 = time.monotonic()
    destroy_weight_group(group, backend="nccl")
    dropped_s = time.monotonic() - t0
    t1 = time.monotonic()
    x = torch.ones(1024, device="cuda") * 2  # the trainer's next kernel, on the default stream
    torch.cuda.current_stream().synchronize()
    default_s = time.monotonic() - t1
    assert x.sum().item() == 2048
    assert dropped_s < 3.0, f"dropping the group took {dropped_s:.1f} s: it waited for the broadcast in flight"
    assert default_s < 3.0, f"the default stream waited {default_s:.1f} s on the sync's broadcast"
