"""A fleet of SGLang servers fed by broadcast (issue 41, rollout/fleet/broadcast.py), on CPU over gloo.

Two real servers join one group with the controller; every bucket goes once, as bytes, to
both. The tests hold the weights (both serve checkpoint b's log-probs and the same version
after the sync) and the deadlines: a server killed before the group forms, between two buckets
of one sync and before the finish ends the sync with one line naming it, well inside the
deadline, and the fleet syncs again once it is restarted.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from proc_utils import alive
from safetensors.torch import load_file
from test_sglang_server import PROMPTS, SHAPE, make_checkpoint

from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.fleet.broadcast import FleetSyncError, WeightBroadcast
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import SGLangServerConfig, sglang_python
from megatron_dapo.rollout.weight_sync import iter_buckets

pytestmark = [
    pytest.mark.sglang_cpu,
    pytest.mark.skipif(sglang_python() is None, reason="SGLang is not installed (make install-sglang-cpu)"),
]

DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet_ckpt")
    return make_checkpoint(root / "a", seed=0), make_checkpoint(root / "b", seed=1)


@pytest.fixture(scope="module")
def fleet(checkpoints, tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    logs = tmp_path_factory.mktemp("fleet_logs")

    def launch(i: int) -> SGLangEngine:  # both at once, as the factory starts a fleet
        config = SGLangServerConfig(model_path=str(checkpoints[0]), device="cpu", dtype="float32",
                                    max_total_tokens=32768, host="127.0.0.1", log_path=str(logs / f"sglang{i}.log"))
        return SGLangEngine.launch(config, name=f"sglang{i}", vocab_size=SHAPE["vocab_size"], startup_timeout_s=600,
                                   live_updates=True)

    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(launch, range(2)))
    yield engines
    pids = [e.process.pid for e in engines]
    for e in engines:
        e.shutdown()
    assert not [p for p in pids if alive(p)], "a server outlived its shutdown"


def buckets(checkpoint: Path) -> list[list]:
    tensors = sorted(load_file(str(checkpoint / "model.safetensors")).items())
    return list(iter_buckets(tensors, 256 * 1024))  # several buckets: a kill can fall between two


def sync(target, checkpoint: Path, version: int, *, kill_before: int | None = None, victim=None) -> None:
    for i, bucket in enumerate(buckets(checkpoint)):
        if i == kill_before:
            os.killpg(victim.process.pid, signal.SIGKILL)
        target.update_weights(bucket)
    target.finish_weight_update(version)


def test_both_servers_take_the_broadcast_weights_and_version(fleet, checkpoints):
    from model_utils import sampled_gaps

    broadcast = WeightBroadcast(fleet, master_address="127.0.0.1", backend="gloo", timeout_s=DEADLINE_S)
    rollout = RolloutController(fleet, transport=broadcast)
    try:
        assert len(buckets(checkpoints[1])) >= 3
        sync(rollout, checkpoints[1], version=3)
        for engine in fleet:
            results = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=1))
            assert {r.weight_versions for r in results} == {(3,)}
            assert float(sampled_gaps(checkpoints[1], PROMPTS, results, 1.0).max()) < 5e-5
            assert float(sampled_gaps(checkpoints[0], PROMPTS, results, 1.0).max()) > 1e-2  # not the old weights
        assert broadcast.bytes_broadcast == sum(t.numel() * t.element_size() for b in buckets(checkpoints[1])
                                                for _, t in b)
        sync(rollout, checkpoints[0], version=4)  # the group formed once serves the next sync
    finally:
        broadcast.close()


@pytest.mark.parametrize("phase", ["group", "between buckets", "finish"])
def test_a_server_killed_during_the_sync_ends_it_in_one_line_naming_it(fleet, checkpoints, phase):
    broadcast = WeightBroadcast(fleet, master_address="127.0.0.1", backend="gloo", timeout_s=DEADLINE_S)
    victim = fleet[1]
    try:
        if phase != "group":
            sync(broadcast, checkpoints[0], version=1)  # the group exists before the kill
        pgid = victim.process.pid
        owned = victim.process.shared_memory_files  # noted from its process tree once healthy
        start = time.monotonic()
        with pytest.raises(FleetSyncError) as caught:
            if phase == "finish":
                for bucket in buckets(checkpoints[1]):
                    broadcast.update_weights(bucket)
                os.killpg(pgid, signal.SIGKILL)
                broadcast.finish_weight_update(2)
            else:
                sync(broadcast, checkpoints[1], version=2, kill_before=0 if phase == "group" else 1, victim=victim)
        elapsed = time.monotonic() - start
        message = str(caught.value)
        assert "sglang1" in caught.value.engines and "sglang1" in message and "\n" not in message, message
        assert elapsed < DEADLINE_S / 2, f"{phase}: {elapsed:.0f} s, near the deadline: it waited instead of noticing"
        assert not alive(pgid)
        if phase == "finish":  # the last kill of the module: the two before held the rejoin
            return
        # Restarted in place, the server rejoins a new group and the fleet syncs again.
        victim.restart()
        # A server killed -9 leaves its /dev/shm files: the restart's stop removed them.
        assert [f for f in owned if Path(f).exists()] == [], owned
        broadcast.engine_replaced(1, victim)
        sync(broadcast, checkpoints[0], version=5)
        assert {r.weight_versions for e in fleet for r in e.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=2))} \
            == {(5,)}
    finally:
        broadcast.close()
