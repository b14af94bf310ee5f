"""Two pipeline stages' sync to a real fleet (fleet/stages.py's turns), stage 1's first rank a process here.

The trainer's per-stage sync exchanges its turns over the stage sources' gloo group (the
two-rank fleet runs in tests/vllm_cpu/test_vllm_train.py and tests/sglang_cpu/test_sglang_async.py);
these tests hold what the servers and the controller do in it: the stage groups formed with every
server, each stage bucket broadcast by its own source (another process, as in a job: torch registers
a group's name once per process) with the controller as rank 1, the controller's copy kept for restarts.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_dapo.rollout.controller import RolloutController


def _stage_source(plan, checkpoint: str, names: list[list[str]], pipe) -> None:
    """Stage 1's first rank: join the stage's group as rank 0, broadcast each bucket when told."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_dapo.rollout.fleet.broadcast import flat_bytes, wire_order
    from megatron_dapo.rollout.fleet.stages import StageSender

    tensors = load_file(checkpoint)
    sender = StageSender()
    thread, holder = sender.start_join(plan)
    thread.join(plan.timeout_s)
    pipe.send("error" not in holder and "group" in holder)
    for bucket in names:
        pipe.recv()
        ordered = wire_order([(n, tensors[n]) for n in bucket])
        holder["group"].broadcast([flat_bytes(ordered)], dist.BroadcastOptions()).wait()
        pipe.send("sent")
    holder["group"].shutdown()


def sync_two_stages(rollout: RolloutController, checkpoint: Path, stage0: Sequence[list], stage1: Sequence[list],
                    version: int) -> None:
    from megatron_dapo.rollout.fleet.broadcast import wire_order
    from megatron_dapo.rollout.fleet.group import bucket_header

    plans = rollout.prepare_stage_groups(2)
    assert plans is not None and len(plans) == 1
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    source = multiprocessing.get_context("spawn").Process(
        target=_stage_source, args=(plans[0], str(checkpoint / "model.safetensors"),
                                    [[n for n, _ in b] for b in stage1], theirs), daemon=True)
    source.start()
    try:
        assert rollout.form_weight_groups()
        assert ours.poll(plans[0].timeout_s) and ours.recv(), "stage 1's first rank did not join its group"
        for bucket in stage0:
            rollout.update_weights(bucket)
        for bucket in stage1:
            header = bucket_header(wire_order(bucket))
            ours.send("go")
            assert rollout.receive_stage_weights(1, header)
            assert ours.poll(plans[0].timeout_s) and ours.recv() == "sent"
        rollout.finish_weight_update(version)
    finally:
        source.join(30)
        if source.is_alive():
            source.kill()


def split_stages(buckets: list[list]) -> tuple[list[list], list[list]]:
    """The first half of the buckets as stage 0's, the rest as stage 1's."""
    half = max(1, len(buckets) // 2)
    return buckets[:half], buckets[half:]


def kept_equal(rollout: RolloutController, buckets: list[list]) -> bool:
    """The controller's copy for restarts holds every tensor of ``buckets``, bit for bit."""
    kept = {n: t for bucket in rollout._kept.buckets for n, t in bucket}
    sent = {n: t for bucket in buckets for n, t in bucket}
    return kept.keys() == sent.keys() and all(torch.equal(kept[n], sent[n]) for n in sent)
