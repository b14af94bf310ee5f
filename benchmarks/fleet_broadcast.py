"""The fleet's weight sync against a plain gloo broadcast of the same bytes (issue 41).

    python benchmarks/fleet_broadcast.py [--engine sglang|vllm] [--engines 1,2] [--repeats 3] [--hidden 512]

A random Qwen2 (hidden --hidden, 4 layers, vocab 32000, float32) is served by 1, then 2 SGLang
(or vLLM: our broadcast transfer engine behind vLLM's weight-transfer API) CPU servers. Per
fleet size, in one sitting:
- sync: the controller's whole step 7 through rollout/fleet/broadcast.WeightBroadcast (every
  bucket of 512 MiB: the servers' requests, one broadcast, their loads; then the version),
  after one warm-up sync that also forms the group;
- plain: the same bytes broadcast from this process over gloo to as many receiver processes as
  the servers have workers, nothing else (the physical limit of the transport here).
The ratio column is plain / sync (goal >= 0.9: the sync adds little to the bytes' own time).
Medians over --repeats. On 2 cores the receivers, the servers and this process share them.
With --calls, where the sync's time goes: each HTTP route the controller called, its seconds
per sync summed over servers and calls (the servers' calls overlap, so the sum can pass the
sync's wall time), medians over --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECEIVER = """
import sys, torch
from datetime import timedelta
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper
host, port, world, rank, numel, repeats, name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
store = dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=300))
group, _ = _new_process_group_helper(world, rank, [], Backend("gloo"), PrefixStore(name, store), group_name=name,
                                     timeout=timedelta(seconds=300), backend_options=None)
buffer = torch.empty(numel, dtype=torch.uint8)
for _ in range(repeats):
    group.broadcast([buffer], dist.BroadcastOptions()).wait()
group.shutdown()  # else gloo's threads are still joinable at exit: "terminate called without an active exception"
"""


def make_checkpoint(directory: Path, hidden: int) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    Qwen2ForCausalLM(config).save_pretrained(str(directory))
    return directory


def launch(engine: str, checkpoint: Path, i: int, engines: int, log_dir: Path):
    """Server i of a fleet of `engines`, as rollout/factory.py starts it (its own cores included)."""
    if engine == "vllm":
        from megatron_dapo.rollout.vllm.engine import VLLMEngine
        from megatron_dapo.rollout.vllm.server import cpu_fleet_binding

        return VLLMEngine.launch(checkpoint, name=f"vllm{i}", log_path=log_dir / f"vllm{i}.log", host="127.0.0.1",
                                 device="cpu", broadcast=True, env=cpu_fleet_binding(i, engines))
    from megatron_dapo.rollout.sglang.engine import SGLangEngine
    from megatron_dapo.rollout.sglang.server import SGLangServerConfig, cpu_fleet_binding

    return SGLangEngine.launch(SGLangServerConfig(model_path=str(checkpoint), device="cpu", dtype="float32",
                                                  max_total_tokens=4096, host="127.0.0.1",
                                                  log_path=str(log_dir / f"sglang{i}.log"),
                                                  env=cpu_fleet_binding(i, engines)),
                               name=f"sglang{i}", startup_timeout_s=900, live_updates=True)


class CallTimer:
    """Seconds per HTTP route of the engine class's one request method, summed until `take()`."""

    def __init__(self, engine: str) -> None:
        import threading

        if engine == "vllm":
            from megatron_dapo.rollout.vllm.engine import VLLMEngine as cls
            method = "_call"
        else:
            from megatron_dapo.rollout.sglang.engine import SGLangEngine as cls
            method = "_request"
        self.seconds: dict[str, float] = {}
        lock, original = threading.Lock(), getattr(cls, method)

        def timed(engine_self, verb, path, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(engine_self, verb, path, *args, **kwargs)
            finally:
                with lock:
                    key = f"{verb} {path}"
                    self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start

        setattr(cls, method, timed)

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return taken


def measure_sync(engine: str, checkpoint: Path, engines: int, repeats: int,
                 log_dir: Path, calls: CallTimer | None = None) -> tuple[float, float, int, dict[str, float]]:
    from safetensors.torch import load_file

    from megatron_dapo.rollout.fleet.broadcast import WeightBroadcast
    from megatron_dapo.rollout.weight_sync import DEFAULT_BUCKET_BYTES, iter_buckets

    servers = [launch(engine, checkpoint, i, engines, log_dir) for i in range(engines)]
    fleet = WeightBroadcast(servers, master_address="127.0.0.1", backend="gloo", timeout_s=600)
    tensors = sorted(load_file(str(checkpoint / "model.safetensors")).items())
    buckets = list(iter_buckets(tensors, DEFAULT_BUCKET_BYTES))
    try:
        times, broadcast, routes = [], [], []
        for version in range(repeats + 1):  # the first forms the group: a warm-up
            if calls is not None:
                calls.take()
            start, before = time.perf_counter(), fleet.seconds_broadcast
            for bucket in buckets:
                fleet.update_weights(bucket)
            fleet.finish_weight_update(version)
            times.append(time.perf_counter() - start)
            broadcast.append(fleet.seconds_broadcast - before)
            routes.append(calls.take() if calls is not None else {})
        keys = sorted({k for r in routes[1:] for k in r})
        per_route = {k: statistics.median(r.get(k, 0.0) for r in routes[1:]) for k in keys}
        return (statistics.median(times[1:]), statistics.median(broadcast[1:]),
                sum(t.numel() * t.element_size() for t in dict(tensors).values()), per_route)
    finally:
        fleet.close()
        for server in servers:
            server.shutdown()


def measure_plain(numel: int, receivers: int, repeats: int) -> float:
    import torch

    from megatron_dapo.launcher import free_port
    from megatron_dapo.rollout.fleet.group import join_weight_group

    port, world, name = free_port("127.0.0.1"), receivers + 1, f"plain-{receivers}"  # a name once per process
    children = [subprocess.Popen([sys.executable, "-c", RECEIVER, "127.0.0.1", str(port), str(world), str(r),
                                  str(numel), str(repeats + 1), name]) for r in range(1, world)]
    try:
        group = join_weight_group(master_address="127.0.0.1", master_port=port, world_size=world, rank=0,
                                  group_name=name, backend="gloo", timeout_s=300)
        buffer = torch.randint(0, 255, (numel,), dtype=torch.uint8)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            group.broadcast([buffer], torch.distributed.BroadcastOptions()).wait()
            times.append(time.perf_counter() - start)
        group.shutdown()
        return statistics.median(times[1:])
    finally:
        for child in children:
            child.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["sglang", "vllm"], default="sglang")
    parser.add_argument("--engines", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--calls", action="store_true", help="also print each HTTP route's seconds per sync")
    args = parser.parse_args()
    calls = CallTimer(args.engine) if args.calls else None
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_checkpoint(Path(tmp) / "model", args.hidden)
        rows, routes = [], []
        for engines in (int(e) for e in args.engines.split(",")):
            sync_s, broadcast_s, num_bytes, per_route = measure_sync(args.engine, checkpoint, engines, args.repeats,
                                                                     Path(tmp), calls)
            plain_s = measure_plain(num_bytes, engines, args.repeats)
            rows.append((engines, num_bytes, sync_s, broadcast_s, plain_s))
            routes.append((engines, per_route))
    # bcast s: the sync's own broadcast call (the servers join it once they have allocated the bucket).
    print(f"engine {args.engine}")
    print(f"{'engines':>7} {'MB':>8} {'sync s':>8} {'bcast s':>8} {'plain s':>8} {'plain/sync':>10} {'sync MB/s':>10}")
    for engines, num_bytes, sync_s, broadcast_s, plain_s in rows:
        print(f"{engines:>7} {num_bytes / 1e6:>8.1f} {sync_s:>8.3f} {broadcast_s:>8.3f} {plain_s:>8.3f} "
              f"{plain_s / sync_s:>10.2f} {num_bytes / 1e6 / sync_s:>10.1f}")
    for engines, per_route in routes if calls is not None else ():
        print(f"engines {engines}: seconds per sync by route, summed over servers")
        for route, seconds in sorted(per_route.items(), key=lambda item: -item[1]):
            print(f"  {seconds:8.3f}  {route}")


if __name__ == "__main__":
    main()
