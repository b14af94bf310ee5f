"""The per-stage sync's turns (rollout/fleet/stages.py) between two real ranks, the fleet's side faked.

Rank 0 is the controller and stage 0's first rank, rank 1 stage 1's; they talk over a gloo
group of the two as ``ControlGroups.stage_sources`` does. The controller's fleet here is a
stand-in that joins stage 1's real weight group (rank 1 of it, hosting its store) and receives
the stage's broadcasts itself, so what is checked is the protocol: the turns' order, that every
stage-1 tensor reaches the controller bit for bit (its copy for restarts), and what happens after
a broadcast fails: the failed bucket sent again point to point (``host``) and the rest too when
the controller keeps weights, nothing sent when it does not (``skip``), and no rank left waiting.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from dist_utils import run_distributed

pytestmark = pytest.mark.multirank


def _tensors(stage: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(stage)
    return [(f"model.layers.{stage}.t{i}", torch.randn(64, 32, generator=generator)) for i in range(6)]


class _Fleet:
    def __init__(self, fail_at: int | None, keeps: bool) -> None:
        self.weights_lock = threading.RLock()
        self.keeps_weights = keeps
        self.failed = False
        self.fail_at = fail_at
        self.group = None
        self.plan = None
        self.calls: list[str] = []
        self.kept: list[tuple[str, torch.Tensor]] = []
        self.broadcasts = 0

    def begin_weight_update(self) -> None:  # restarts what an earlier failed sync marked: none here
        pass

    @property
    def sync_failed(self) -> bool:
        return self.failed

    def prepare_stage_groups(self, stages: int):
        from megatron_dapo.launcher import free_port
        from megatron_dapo.rollout.fleet.broadcast import StageGroup

        self.calls.append("prepare")
        self.plan = StageGroup(stage=1, name="test-fleet-stage1", master_address="127.0.0.1",
                               master_port=free_port("127.0.0.1"), world_size=2, backend="gloo", timeout_s=30.0)
        return [self.plan]

    def form_weight_groups(self) -> bool:
        from megatron_dapo.rollout.fleet.group import join_weight_group

        self.calls.append("form")
        p = self.plan
        self.group = join_weight_group(master_address=p.master_address, master_port=p.master_port,
                                       world_size=2, rank=1, group_name=p.name, timeout_s=30.0, store_master=True)
        return True

    def update_weights(self, bucket) -> None:
        self.calls.append("stage0")
        self.kept.extend((n, t.clone()) for n, t in bucket)

    def receive_stage_weights(self, stage: int, header) -> bool:
        import torch.distributed as dist

        from megatron_dapo.rollout.fleet.group import flat_nbytes, split_flat

        self.calls.append(f"go{stage}")
        if self.broadcasts == self.fail_at:  # a server died: the group breaks before this bucket's bytes arrive
            self.failed = True
            self.group.shutdown()
            return False
        self.broadcasts += 1
        dtypes, shapes = [getattr(torch, d) for _, d, _ in header], [s for _, _, s in header]
        flat = torch.empty(flat_nbytes(dtypes, shapes), dtype=torch.uint8)
        self.group.broadcast([flat], dist.BroadcastOptions()).wait()
        self.kept.extend(zip([n for n, _, _ in header], split_flat(flat, dtypes, shapes)))
        return True

    def keep_weights_bucket(self, bucket) -> None:
        self.calls.append("host")
        self.kept.extend(bucket)

    def finish_weight_update(self, version=None) -> None:
        self.calls.append(f"finish{version}")


def _sync(fail_at: int | None, keeps: bool) -> dict:
    import torch.distributed as dist

    from megatron_dapo import parallel
    from megatron_dapo.rollout.fleet.stages import StageSender, sync_by_stage

    rank = parallel.init_distributed("cpu").rank
    group = dist.new_group([0, 1], backend="gloo")
    fleet = _Fleet(fail_at, keeps) if rank == 0 else None
    sender = StageSender()
    # Buckets of two tensors (16 KiB in all): three per stage.
    stats = sync_by_stage(iter(_tensors(rank)), fleet=fleet, sender=sender, group=group, source_ranks=(0, 1),
                          rank=rank, bucket_bytes=2 * 64 * 32 * 4, version=7)
    sender.drop()
    result = {"bytes": stats.num_bytes, "buckets": stats.num_buckets}
    if fleet is not None:
        result.update(calls=fleet.calls, kept=fleet.kept)
    return result


@pytest.mark.parametrize(("fail_at", "keeps"), [(None, True), (1, True), (0, False)])
def test_stage_turns_deliver_every_tensor_and_survive_a_failed_broadcast(fail_at, keeps) -> None:
    start = time.monotonic()
    controller, source = run_distributed(_sync, 2, fail_at, keeps, timeout_s=120)
    # No rank waits out the broken group's 30 s deadline (the stage's send is left on its thread).
    assert time.monotonic() - start < 25, time.monotonic() - start
    # One global order: the groups, stage 0's buckets, stage 1's turns, the finish.
    calls = controller["calls"]
    assert calls[:2] == ["prepare", "form"] and calls[2:5] == ["stage0"] * 3 and calls[-1] == "finish7", calls
    expected = _tensors(0) + _tensors(1)
    if keeps:
        # Every tensor kept, bit for bit: by broadcast until the failure, then sent again point to point.
        assert [n for n, _ in controller["kept"]] == [n for n, _ in expected]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(controller["kept"], expected))
    else:
        assert [n for n, _ in controller["kept"]] == [n for n, _ in _tensors(0)]  # stage 1: nothing sent
    if fail_at is None:
        assert calls[5:-1] == ["go1"] * 3
        assert source["buckets"] == 3 and controller["bytes"] == 2 * source["bytes"]
    elif keeps:
        assert calls[5:-1] == ["go1", "go1", "host", "host"], calls  # the failed bucket again, then the last
        assert source["buckets"] == 3
    else:
        assert calls[5:-1] == ["go1"], calls  # skipped after the failure
        assert source["buckets"] == 1 and controller["buckets"] == 4  # the failed one counted, not the skipped
