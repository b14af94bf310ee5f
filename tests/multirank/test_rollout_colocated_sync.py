"""Colocated engines on 2 "nodes" x 2 "GPUs" (4 gloo ranks): launch, weight sync, memory, failures.

Each leader rank "launches" an engine by starting a fake SGLang HTTP server in a thread of
its own process and driving it with the real SGLangEngine client, so what is checked is the
JSON each leader really POSTs. CUDA IPC is replaced by an injected serializer that writes
down which rank (and so which GPU) serialized what. The export is a collective generator
like ``export_hf``: every rank yields the same full tensors, with an all-reduce per tensor.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from dist_utils import run_distributed

pytestmark = pytest.mark.multirank

SHAPES = {"embed": (64, 32), "norm": (32,), "q": (64, 64), "bias": (16,), "mlp": (128, 32), "head": (8, 8)}
BUCKET_BYTES = 16 * 1024


def _tensors() -> list[tuple[str, Any]]:
    import torch

    out = []
    for i, (name, shape) in enumerate(SHAPES.items()):
        numel = 1
        for s in shape:
            numel *= s
        out.append((name, (torch.arange(numel, dtype=torch.float32) * (i + 1)).reshape(shape)))
    return out


def _export():
    """Like export_hf: collective, every rank gets every full tensor."""
    import torch
    import torch.distributed as dist

    for name, tensor in _tensors():
        dist.all_reduce(torch.ones(1))
        yield name, tensor


def _describe(payload) -> str:
    """Stands in for CUDA IPC serialization: who serialized which tensors (read back from a flat buffer)."""
    import torch.distributed as dist

    from megatron_dapo.rollout.flat_bucket import FlatBucket, unflatten

    flat = isinstance(payload, FlatBucket)
    pairs = unflatten(payload) if flat else payload
    return json.dumps({"rank": dist.get_rank(), "local_rank": int(os.environ["LOCAL_RANK"]), "flat": flat,
                       "tensors": [[n, float(t.double().sum()), list(t.shape)] for n, t in pairs]})


class _FakeServer:
    """Answers SGLang's control endpoints with 200, records every request."""

    def __init__(self, api_key: str, fail_update_at: int | None = None) -> None:
        self.requests: list[tuple[str, str, bool, Any]] = []
        fake = self
        num_updates = [0]

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                authorized = self.headers.get("Authorization") == f"Bearer {api_key}"
                fake.requests.append((self.command, self.path, authorized, body))
                code = 200 if authorized else 401
                if self.path == "/update_weights_from_tensor":
                    num_updates[0] += 1
                    if num_updates[0] == fail_update_at:
                        code = 500
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = _serve

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _scenario(tp: int, *, fail_update_on: int | None = None, fail_start_on: int | None = None,
              weight_format: str = "tensors") -> dict:
    """One launch + sync + release/resume on this rank; returns what it saw."""
    import torch.distributed as dist

    from megatron_dapo.rollout.engine import EngineError
    from megatron_dapo.rollout.sglang.colocated import (
        ColocatedEngines,
        EngineInfo,
        plan_placement,
        ranks_per_node_from_env,
    )
    from megatron_dapo.rollout.sglang.engine import SGLangEngine

    rank = dist.get_rank()
    servers: list[_FakeServer] = []
    shutdowns: list[str] = []
    released_at: list[float] = []
    resumed_at: list[float] = []

    class OwnedEngine(SGLangEngine):
        def shutdown(self) -> None:
            shutdowns.append(self.name)

        def resume_memory(self) -> None:
            resumed_at.append(time.time())
            super().resume_memory()

    def release_cache() -> None:
        time.sleep(0.5 if rank % 2 else 0.0)  # a slow member rank: its engine must wait for it
        released_at.append(time.time())

    def start(slot):
        if slot.index == fail_start_on:
            raise RuntimeError("server exited with code 1 (CUDA out of memory)")
        key = f"key-{slot.index}"
        server = _FakeServer(key, fail_update_at=2 if slot.index == fail_update_on else None)
        servers.append(server)
        engine = OwnedEngine(server.url, name=slot.name, api_key=key, tp_size=slot.tp_size)
        return engine, EngineInfo(name=slot.name, url=server.url, api_key=key, tp_size=slot.tp_size,
                                  leader_rank=slot.leader_rank, node=slot.node, host="localhost", log_path="x.log")

    def client(info):
        return SGLangEngine(info.url, name=info.name, api_key=info.api_key, tp_size=info.tp_size)

    placement = plan_placement(world_size=dist.get_world_size(), gpus_per_node=ranks_per_node_from_env(4),
                               engine_tp=tp)
    out: dict[str, Any] = {}
    try:
        engines = ColocatedEngines.create(placement, rank=rank, local_rank=int(os.environ["LOCAL_RANK"]),
                                          start_engine=start, make_client=client, serializer=_describe,
                                          weight_format=weight_format)
    except EngineError as err:
        return {"start_error": str(err), "shutdowns": shutdowns}
    out["group"] = dist.get_process_group_ranks(engines.group)
    out["leader"] = engines.is_leader
    if rank == 0:
        out["clients"] = [(c.name, c.base_url, c.health(timeout_s=10)) for c in engines.clients]
        out["server_urls"] = [i.url for i in engines.infos]
    try:
        out["stats"] = engines.sync_weights(_export(), bucket_bytes=BUCKET_BYTES)
        out["health"] = engines.health()
        engines.release_memory()
        engines.resume_memory(release_cache=release_cache)
        out["released_at"], out["resumed_at"] = released_at, resumed_at
    except EngineError as err:
        out["sync_error"] = str(err)
    # Everyone is done posting before the leaders read their records.
    dist.barrier()
    # Health checks come from the controller (before the sync) and from the leader (after it).
    out["num_health_checks"] = sum(r[1] == "/health_generate" for s in servers for r in s.requests)
    out["requests"] = [r for s in servers for r in s.requests if r[1] != "/health_generate"]
    engines.shutdown()
    out["shutdowns"] = shutdowns
    return out


def _run_all() -> dict:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    # Two "nodes" of two "GPUs": ranks 0,1 on node 0 and 2,3 on node 1.
    os.environ["LOCAL_RANK"] = str(rank % 2)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", init_method="env://")
    return {
        "tp2": _scenario(2),
        "tp1": _scenario(1),
        "tp2_flat": _scenario(2, weight_format="flattened_bucket"),
        "update_fails": _scenario(2, fail_update_on=1),
        "start_fails": _scenario(2, fail_start_on=1),
    }


def _expected_buckets() -> list[list[list]]:
    from megatron_dapo.rollout.weight_sync import iter_buckets

    return [[[n, float(t.double().sum()), list(t.shape)] for n, t in bucket]
            for bucket in iter_buckets(_tensors(), BUCKET_BYTES)]


def _updates(requests: list) -> list[list[dict]]:
    return [[json.loads(s) for s in body["serialized_named_tensors"]]
            for method, path, _, body in requests if path == "/update_weights_from_tensor"]


def test_colocated_engines_on_two_nodes() -> None:
    results = run_distributed(_run_all, 4, timeout_s=120)
    buckets = _expected_buckets()
    assert len(buckets) >= 3

    for tp, num_engines, flat in [(2, 2, False), (1, 4, False), (2, 2, True)]:
        runs = [r[f"tp{tp}_flat" if flat else f"tp{tp}"] for r in results]
        leaders = [rank for rank in range(4) if runs[rank]["leader"]]
        assert leaders == list(range(0, 4, tp))
        for rank in range(4):
            lead = rank - rank % tp
            assert runs[rank]["group"] == list(range(lead, lead + tp))
            if rank not in leaders:
                assert runs[rank]["requests"] == []
                continue
            requests = runs[rank]["requests"]
            assert all(authorized for _, _, authorized, _ in requests)
            updates = _updates(requests)
            # Every bucket once, one payload per engine TP rank, each from the rank on that GPU.
            assert len(updates) == len(buckets)
            for payloads, bucket in zip(updates, buckets):
                assert [p["rank"] for p in payloads] == list(range(rank, rank + tp))
                assert [p["local_rank"] for p in payloads] == [(rank % 2) + i for i in range(tp)]
                assert all(p["tensors"] == bucket and p["flat"] is flat for p in payloads)
            bodies = [b for _, path, _, b in requests if path == "/update_weights_from_tensor"]
            load_format = "flattened_bucket" if flat else None
            assert all(b["flush_cache"] is False and b["load_format"] == load_format for b in bodies)
            # One session around the buckets, flush after it, then release (SGLang flushes first) and resume.
            paths = [path for _, path, _, _ in requests]
            assert paths[0] == "/begin_weight_update"
            assert paths[1 + len(buckets):] == ["/end_weight_update", "/flush_cache", "/flush_cache",
                                                "/release_memory_occupation", "/resume_memory_occupation"]
            assert runs[rank]["num_health_checks"] == 2
            stats = runs[rank]["stats"]
            assert (stats.num_buckets, stats.num_tensors) == (len(buckets), len(SHAPES))
            assert stats.peak_bucket_bytes <= BUCKET_BYTES + 128 * 32 * 4
        assert all(runs[rank]["health"] == {f"sglang{e}": True for e in range(num_engines)} for rank in range(4))
        # Memory hand-over: every rank emptied its allocator cache before any engine resumed.
        assert sorted(len(r["released_at"]) for r in runs) == [1, 1, 1, 1]
        assert max(t for r in runs for t in r["released_at"]) <= min(t for r in runs for t in r["resumed_at"])
        # The controller reaches every engine of both nodes with its address and key.
        clients = runs[0]["clients"]
        assert [c[0] for c in clients] == [f"sglang{e}" for e in range(num_engines)]
        assert [c[1] for c in clients] == runs[0]["server_urls"]
        assert all(c[2] is True for c in clients)
        assert all(runs[rank]["shutdowns"] == ([f"sglang{rank // tp}"] if rank in leaders else []) for rank in range(4))

    # Engine 1 (node 1) rejects its 2nd bucket: every rank raises naming it; engine 0 got everything.
    runs = [r["update_fails"] for r in results]
    for rank in range(4):
        assert "weight sync failed on 1 engine(s): sglang1: EngineError" in runs[rank]["sync_error"]
        assert "HTTP 500" in runs[rank]["sync_error"]
    assert len(_updates(runs[0]["requests"])) == len(buckets)
    assert len(_updates(runs[2]["requests"])) == 2
    assert "/flush_cache" not in [p for _, p, _, _ in runs[2]["requests"]]

    # Engine 1 does not come up: every rank raises naming it, engine 0's leader stops its server.
    runs = [r["start_fails"] for r in results]
    for rank in range(4):
        assert "1 colocated SGLang engine(s) failed to start: sglang1 (rank 2 on" in runs[rank]["start_error"]
        assert "CUDA out of memory" in runs[rank]["start_error"]
    assert [r["shutdowns"] for r in runs] == [["sglang0"], [], [], []]
