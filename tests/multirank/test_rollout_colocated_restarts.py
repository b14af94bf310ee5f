"""Restarts of colocated servers that the controller does not own (2 gloo ranks, 2 engines).

Rank 1 leads engine sglang1; rank 0 (the controller) holds a client of it. What is checked
is the protocol of rollout/sglang/restarts.py and ColocatedEngines around it, with the real
SGLangEngine client against fake HTTP servers (what the real server does is held by
tests/sglang_cpu/test_sglang_train.py, which kills a real one mid-generation):

- the controller's restart() of sglang1 is served by rank 1's thread while rank 1 waits in
  a collective (as it does in the step's dispatch): relaunch, then the kept buckets of the
  last sync and its version;
- a server found dead at the release is relaunched at the resume (no weights: the sync
  after the resume brings them), counted in the same job-wide budget;
- past the budget, the resume raises EngineRestartsExhausted on every rank, and the
  controller's request is answered "exhausted".
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import pytest
from dist_utils import run_distributed
from test_rollout_colocated_sync import SHAPES, _describe, _export, _FakeServer
from test_rollout_colocated_sync import _tensors as _export_tensors

from megatron_dapo.rollout.host_arena import MIN_BLOCK_BYTES

pytestmark = pytest.mark.multirank


def _scenario() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from megatron_dapo.rollout.engine import EngineRestartsExhausted
    from megatron_dapo.rollout.sglang.colocated import ColocatedEngines, EngineInfo, plan_placement
    from megatron_dapo.rollout.sglang.engine import SGLangEngine

    rank = dist.get_rank()
    servers: list[_FakeServer] = []
    relaunches: list[int] = []

    class OwnedEngine(SGLangEngine):
        dead = False

        @property
        def exited(self) -> bool:
            return self.dead

        def relaunch(self, *, startup_timeout_s: float = 900.0) -> None:
            relaunches.append(len(servers[0].requests))  # where in the request log it happened
            self.dead = False

        def shutdown(self) -> None:
            pass

    def start(slot):
        key = f"key-{slot.index}"
        server = _FakeServer(key)
        servers.append(server)
        engine = OwnedEngine(server.url, name=slot.name, api_key=key, tp_size=slot.tp_size, serializer=_describe)
        return engine, EngineInfo(name=slot.name, url=server.url, api_key=key, tp_size=slot.tp_size,
                                  leader_rank=slot.leader_rank, node=slot.node, host="localhost", log_path="x.log")

    def client(info):
        return SGLangEngine(info.url, name=info.name, api_key=info.api_key, tp_size=info.tp_size)

    placement = plan_placement(world_size=2, gpus_per_node=2, engine_tp=1)
    engines = ColocatedEngines.create(placement, rank=rank, local_rank=rank, start_engine=start, make_client=client,
                                      serializer=_describe, weight_format="tensors", max_restarts=2)
    out: dict[str, Any] = {"restartable": [bool(c.restartable) for c in engines.clients]}
    engines.sync_weights(_export(), bucket_bytes=16 * 1024, version=6)
    buffers = {name: t.data_ptr() for name, t in engines._host_buffers.items()}
    # A second sync reuses the leader's host buffers (one copy of the weights, not two at the peak).
    engines.sync_weights(((name, t * 2) for name, t in _export()), bucket_bytes=16 * 1024, version=7)
    if engines._restart_server is not None:
        out["buffers_reused"] = buffers == {name: t.data_ptr() for name, t in engines._host_buffers.items()}
        out["kept_is_second_sync"] = all(torch.equal(t, dict(_export_tensors())[name] * 2)
                                         for bucket in engines._kept for name, t in bucket)
        out["kept_bytes"] = engines._host_buffers.used_bytes
        out["reserved_bytes"] = engines._host_buffers.reserved_bytes  # the arena's blocks (rollout/host_arena.py)
    synced = len(servers[0].requests)

    # 1. The controller asks; rank 1 serves from its thread while its main thread waits here.
    if rank == 0:
        engines.clients[1].restart()
    dist.barrier()
    out["relaunches_after_request"] = list(relaunches)
    out["reload"] = [(path, body) for _, path, _, body in servers[0].requests[synced:]]
    out["count_after_request"] = engines.num_restarts()

    # 2. Dead at the release: relaunched at the resume, on this rank's own step.
    if rank == 1:
        engines.engine.dead = True  # type: ignore[union-attr]
    engines.release_memory()
    before = len(servers[0].requests)
    engines.resume_memory()
    out["relaunches_after_resume"] = list(relaunches)
    out["resume_requests"] = [path for _, path, _, _ in servers[0].requests[before:]]
    out["count_after_resume"] = engines.num_restarts()

    # 3. The budget (2) is spent: the next death stops the run on every rank, with its own error.
    if rank == 1:
        engines.engine.dead = True  # type: ignore[union-attr]
    engines.release_memory()
    try:
        engines.resume_memory()
    except EngineRestartsExhausted as err:
        out["exhausted"] = str(err)
    if rank == 0:
        try:
            engines.clients[1].restart()
        except EngineRestartsExhausted as err:
            out["request_exhausted"] = str(err)
    dist.barrier()
    engines.shutdown()
    return out


def _run() -> dict[str, Any]:
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = os.environ["RANK"]
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", init_method="env://")
    return _scenario()


def test_the_owner_restarts_its_server_for_the_controller_and_at_the_resume() -> None:
    results = run_distributed(_run, 2, timeout_s=120)
    controller, owner = results
    assert controller["restartable"] == [True, True]
    # Served by rank 1: one relaunch, then every kept tensor once and the version of the last sync.
    assert owner["relaunches_after_request"] == [owner["relaunches_after_request"][0]]
    assert owner["buffers_reused"] and owner["kept_is_second_sync"]
    assert owner["kept_bytes"] == sum(math.prod(shape) * 4 for shape in SHAPES.values())
    assert owner["reserved_bytes"] == MIN_BLOCK_BYTES  # one block for a model this small, not one per tensor
    reload = owner["reload"]
    sent = [tensor[0] for path, body in reload if path == "/update_weights_from_tensor"
            for tensor in json.loads(body["serialized_named_tensors"][0])["tensors"]]
    assert sent == list(SHAPES)
    versions = [body for path, body in reload if path == "/update_weight_version"]
    assert [v["new_version"] for v in versions] == ["7"]
    assert controller["count_after_request"] == owner["count_after_request"] == 1
    # At the resume: relaunched without a resume call (a fresh server holds its memory) and counted.
    assert len(owner["relaunches_after_resume"]) == 2
    assert "/resume_memory_occupation" not in owner["resume_requests"]
    assert controller["count_after_resume"] == owner["count_after_resume"] == 2
    for run in results:
        assert "resume_memory failed on 1 engine(s): sglang1: its server died" in run["exhausted"]
        assert "rollout.max_engine_restarts=2 are spent" in run["exhausted"]
    assert "engine sglang1 failed after 2 restart(s)" in controller["request_exhausted"]
