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

    from megatron_dapo.rollout.fleet.group import destroy_weight_group, join_weight_group, on_device
    from megatron_dapo.rollout.server_process import free_port

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
