"""Step 7 for a fleet under pipeline parallelism: one broadcast group per pipeline stage.

With PP > 1 the controller's single group (broadcast.py) needs every stage's tensors gathered
to the controller first, so each byte of stages 1.. crosses the network twice. Here each
stage's first rank (``parallel.stage_source``: its first data-parallel, tensor-parallel rank)
receives only its own stage's tensors (``export_hf(receivers="stages")``, models/export.py) and
broadcasts them itself, in a group of its own: rank 0 the stage's first rank, rank 1 the
controller, then every server's workers (``WeightBroadcast.prepare_stages``). The controller
is the group's rank 1 for two reasons: it hosts the group's store at the address the servers
already reach, and the broadcast hands it the bucket, which it keeps as the copy a restarted
server is loaded from (``RolloutController``; on GPUs that copy costs one more member of each
NCCL broadcast, not a second send).

A server takes one bucket at a time (sglang's scheduler and our vLLM backend receive
synchronously), so the stages take turns in one global order, as slime's per-bucket lock
does: stage 0's buckets (the controller's own, sent in the controller's group as without
PP), then stage 1's, and so on. The turns run over ``ControlGroups.stage_sources`` (gloo, the
first rank of every stage): for each bucket the stage's first rank sends the controller its
header (names, dtypes, shapes in wire order), the controller answers

- ``go``: asks every server to receive the bucket on the stage's group and joins its broadcast
  (then ``done``; or, when that failed, ``host`` if the controller still needs its copy, else
  ``dropped``: the stage's send is left to end at its deadline on a thread of its own, the group
  formed anew at the next sync, so no rank waits on a broken group);
- ``host``: the sync already failed (every server is restarted with the kept weights before its
  next use), so only the controller takes the bucket, point to point, to keep it;
- ``skip``: the sync failed and no copy is kept (no restarts): the stage only drains its export.

At the sync's start the controller tells the stage sources whether the groups must be formed
again (first sync, after a restart or a failure) and, once it has formed them with the servers,
whether that worked. Deadlines: every group has ``rollout.fleet_sync_timeout_s`` for its
rendezvous and each collective; a stage source whose group failed to form drops it and sends
nothing, and a failed broadcast is named by the controller's FleetSyncError (broadcast.py),
after which the stages are told ``host`` or ``skip``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_dapo.faults import fault_point
from megatron_dapo.rollout.fleet.broadcast import StageGroup, flat_bytes, wire_order
from megatron_dapo.rollout.fleet.group import (
    abort_weight_group,
    broadcast_bytes,
    bucket_header,
    destroy_weight_group,
    flat_nbytes,
    header_layout,
    join_weight_group,
    side_stream,
    split_flat,
)
from megatron_dapo.rollout.weight_sync import BucketMeter, WeightSyncStats, iter_buckets

__all__ = ["StageFleet", "StageSender", "sync_by_stage"]

logger = logging.getLogger(__name__)

Header = list[tuple[str, str, list[int]]]


class StageFleet(Protocol):
    """The controller's side (RolloutController with a WeightBroadcast transport)."""

    weights_lock: Any
    keeps_weights: bool

    def begin_weight_update(self) -> None: ...

    @property
    def sync_failed(self) -> bool: ...

    def prepare_stage_groups(self, stages: int) -> list[StageGroup] | None: ...

    def form_weight_groups(self) -> bool: ...

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None: ...

    def receive_stage_weights(self, stage: int, header: Header) -> bool: ...

    def keep_weights_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None: ...

    def finish_weight_update(self, version: int | None = None) -> None: ...


class StageSender:
    """A stage source's side: its group, joined as rank 0, kept from one sync to the next."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self.name = ""
        self.backend = "gloo"
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def drop(self) -> None:
        """Leave the group for good before joining the next one (no broadcast runs on it: the last
        sync's ended, or ``abandon`` already let it go): ``destroy_weight_group``, as the servers'
        workers do, since a gloo group's shutdown alone frees nothing (fleet/group.py)."""
        group, self.group, self.name = self.group, None, ""
        if group is not None:
            destroy_weight_group(group, backend=self.backend)

    def broadcast(self, flat: torch.Tensor, stage: int) -> threading.Thread:
        """Broadcast one bucket's bytes as the group's rank 0, on a thread (``abandon`` leaves it)."""
        group = self.group
        # Waited on the sync's own stream, not the default one where this rank trains (group.side_stream).
        stream = side_stream(flat, self._streams)

        def send() -> None:
            try:
                if group is None:
                    raise RuntimeError("this stage's weight group is not formed")
                broadcast_bytes(group, flat, stream)
            except Exception as err:  # the controller's FleetSyncError names who failed
                logger.warning("pipeline stage %d's weight broadcast failed: %s", stage, err)

        thread = threading.Thread(target=send, name=f"stage-broadcast-{stage}", daemon=True)
        thread.start()
        return thread

    def abandon(self) -> None:
        """Forget a group whose broadcast failed elsewhere. A gloo send ends at the group's deadline (a
        gloo group is not shut down under an operation in flight); an NCCL one waits with no
        deadline but the watchdog's, which would end this rank, so its communicator is aborted
        (group.abort_weight_group: a shutdown would wait for the broadcast in flight)."""
        group, self.group, self.name = self.group, None, ""
        if group is not None and self.backend == "nccl":
            abort_weight_group(group)

    def start_join(self, plan: StageGroup) -> tuple[threading.Thread, dict[str, Any]]:
        """Join ``plan``'s group in a thread (its rendezvous waits for the servers the controller asks)."""
        self.drop()
        holder: dict[str, Any] = {}

        def join() -> None:
            try:
                holder["group"] = join_weight_group(master_address=plan.master_address, master_port=plan.master_port,
                                                    world_size=plan.world_size, rank=0, group_name=plan.name,
                                                    backend=plan.backend, timeout_s=plan.timeout_s, store_master=False)
            except BaseException as err:  # the controller says whether forming worked; this is logged
                holder["error"] = err

        thread = threading.Thread(target=join, name=f"stage-group-{plan.stage}", daemon=True)
        thread.start()
        return thread, holder


def sync_by_stage(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    fleet: StageFleet | None,
    sender: StageSender,
    group: dist.ProcessGroup | None,
    source_ranks: Sequence[int],
    rank: int,
    bucket_bytes: int,
    version: int | None,
) -> WeightSyncStats:
    """Step 7 with one broadcast group per pipeline stage (module docstring); call on every rank.

    Args:
        named_tensors: ``export_hf(receivers="stages")`` (collective: every rank consumes it fully).
        fleet: the controller's RolloutController; None on the other ranks.
        sender: this rank's StageSender (used on stage sources 1..).
        group: ``ControlGroups.stage_sources`` on a stage's first rank; None on the others.
        source_ranks: each stage's first global rank, by stage.
        rank: this rank's global rank.
        bucket_bytes: budget per bucket.
        version: the weights' version.

    Returns:
        What was sent (on the controller: every stage's buckets; on a stage source: its own).
    """
    start = time.perf_counter()
    meter = BucketMeter()
    if rank == source_ranks[0]:
        assert fleet is not None and group is not None, "the controller drives the per-stage sync"
        counts = _controller(named_tensors, fleet, group, source_ranks, bucket_bytes, meter, version)
    elif rank in source_ranks:
        assert group is not None
        counts = _stage_source(named_tensors, sender, group, source_ranks, source_ranks.index(rank), bucket_bytes,
                               meter)
    else:
        for _ in named_tensors:
            pass  # this rank's shards go to its stage's first rank inside the export
        counts = (0, 0, 0)
    num_bytes, num_tensors, num_buckets = counts
    return WeightSyncStats(num_bytes=num_bytes, num_tensors=num_tensors, num_buckets=num_buckets,
                           seconds=time.perf_counter() - start, peak_bucket_bytes=meter.peak_bytes)


def _controller(named_tensors: Iterable[tuple[str, torch.Tensor]], fleet: StageFleet, group: dist.ProcessGroup,
                source_ranks: Sequence[int], bucket_bytes: int, meter: BucketMeter,
                version: int | None) -> tuple[int, int, int]:
    num_bytes = num_tensors = num_buckets = 0
    # A restart waits for the whole sync: the groups' members must not change between the turns.
    with fleet.weights_lock:
        fleet.begin_weight_update()  # engines an earlier failed sync marked are restarted first
        plans = None if fleet.sync_failed else fleet.prepare_stage_groups(len(source_ranks))
        dist.broadcast_object_list([plans], src=source_ranks[0], group=group)
        if plans is not None:
            formed = fleet.form_weight_groups()
            dist.broadcast_object_list([formed], src=source_ranks[0], group=group)
        for bucket in iter_buckets(named_tensors, bucket_bytes, meter):
            fleet.update_weights(bucket)
            num_buckets, num_tensors = num_buckets + 1, num_tensors + len(bucket)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            del bucket  # not held while the export gathers the next one (weight_sync.py)
        for stage, src in enumerate(source_ranks[1:], start=1):
            while True:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=src, group=group)
                header: Header | None = box[0]
                if header is None:
                    break
                answer = "go" if not fleet.sync_failed else "host" if fleet.keeps_weights else "skip"
                dist.send_object_list([answer], dst=src, group=group)
                if answer == "go":
                    # A failed broadcast leaves the controller without the bucket: sent again, to keep.
                    received = fleet.receive_stage_weights(stage, header)
                    answer = "done" if received else "host" if fleet.keeps_weights else "dropped"
                    dist.send_object_list([answer], dst=src, group=group)
                if answer == "host":
                    fleet.keep_weights_bucket(_receive_host_copy(header, src, group))
                if answer != "skip":
                    _, dtypes, shapes = header_layout(header)
                    num_buckets, num_tensors = num_buckets + 1, num_tensors + len(header)
                    num_bytes += flat_nbytes(dtypes, shapes)
        fleet.finish_weight_update(version)
    return num_bytes, num_tensors, num_buckets


def _receive_host_copy(header: Header, src: int, group: dist.ProcessGroup) -> list[tuple[str, torch.Tensor]]:
    names, dtypes, shapes = header_layout(header)
    flat = torch.empty(flat_nbytes(dtypes, shapes), dtype=torch.uint8)
    dist.recv(flat, src=src, group=group)
    return list(zip(names, split_flat(flat, dtypes, shapes), strict=True))


def _stage_source(named_tensors: Iterable[tuple[str, torch.Tensor]], sender: StageSender, group: dist.ProcessGroup,
                  source_ranks: Sequence[int], stage: int, bucket_bytes: int,
                  meter: BucketMeter) -> tuple[int, int, int]:
    controller = source_ranks[0]
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=controller, group=group)
    plans: list[StageGroup] | None = box[0]
    if plans is not None:
        thread, holder = sender.start_join(plans[stage - 1])
        dist.broadcast_object_list(box, src=controller, group=group)
        if box[0]:
            thread.join(timeout=plans[stage - 1].timeout_s)
        if box[0] and "group" in holder:
            sender.group, sender.name, sender.backend = holder["group"], plans[stage - 1].name, plans[stage - 1].backend
        else:
            logger.warning("pipeline stage %d's weight group was not formed (%s); the controller names why",
                           stage, holder.get("error", "the controller's side failed"))
    num_bytes = num_tensors = num_buckets = 0
    for bucket in iter_buckets(named_tensors, bucket_bytes, meter):
        ordered = wire_order(bucket)
        del bucket
        header = bucket_header(ordered)
        dist.send_object_list([header], dst=controller, group=group)
        dist.recv_object_list(box, src=controller, group=group)
        if box[0] == "go":
            sending = sender.broadcast(flat_bytes(ordered), stage)
            fault_point("broadcast", source_ranks[stage])
            # "done": every receiver took it. Otherwise the broadcast failed on the controller's side
            # ("host": it still needs its copy): the stage's send, which gloo would hold until the
            # group's deadline, is left to end there on its thread, and the group is formed anew.
            dist.recv_object_list(box, src=controller, group=group)
            if box[0] == "done":
                sending.join()
            else:
                sender.abandon()
        if box[0] == "host":  # over the ranks' gloo control group: host memory
            dist.send(flat_bytes(ordered).cpu(), dst=controller, group=group)
        if box[0] != "skip":
            num_buckets, num_tensors = num_buckets + 1, num_tensors + len(ordered)
            num_bytes += sum(t.numel() * t.element_size() for _, t in ordered)
        del ordered
    dist.send_object_list([None], dst=controller, group=group)
    return num_bytes, num_tensors, num_buckets
