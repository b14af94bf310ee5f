"""A fleet of SGLang servers fed by broadcast (issue 41, rollout/fleet/broadcast.py), on CPU over gloo.

Two real servers join one group with the controller; every bucket goes once, as bytes, to
both. The tests hold the weights (both serve checkpoint b's log-probs and the same version
after the sync) and the deadlines: a server killed before the group forms, between two buckets
of one sync and before the finish ends the sync with one line naming it, well inside the
deadline, and the fleet syncs again once it is restarted. A trainer SIGKILLed at each phase of its
first sync (init, metadata, finish) leaves no server process behind.
"""

from __future__ import annotations

import contextlib
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


TRAINER_KILL_LOGS = {
    # phase: (answered in both servers' logs, not answered in either)
    "fleet_init": ((), ('POST /init_weights_update_group HTTP/1.1" 200',)),
    "fleet_metadata": (('POST /init_weights_update_group HTTP/1.1" 200',),
                       ('POST /update_weights_from_distributed HTTP/1.1" 200',)),
    "fleet_finish": (('POST /update_weights_from_distributed HTTP/1.1" 200',), ()),
}


@pytest.mark.parametrize("phase", sorted(TRAINER_KILL_LOGS))
def test_a_trainer_killed_in_a_fleet_sync_takes_its_fleet_with_it(tmp_path, phase):
    """Issue 41: the controller SIGKILLed (MEGATRON_DAPO_FAULT=<phase>:0:kill, no cleanup runs) in
    its first sync: the servers asked to join its group, sent the first bucket's metadata (waiting
    in its broadcast), or asked to finish (the vLLM fleet's test kills it in the broadcast itself).
    Nothing hangs: every process the run started (the server and its scheduler and detokenizer
    processes) is gone within 15 s, by the servers' reaper (lifetime.py)."""
    import subprocess
    import sys
    import uuid

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from trainer_utils import REPO, assert_run_gone, run_processes, train_command, trainer_env

    out = tmp_path / "run"
    # A fleet of one server (two cost a minute more of CI for the three phases; the vLLM fleet's
    # kill has two), the scratch model with a verifier that needs no skill, one small step.
    command = train_command(REPO / "examples" / "tiny_cpu.yaml", "rollout.engine=sglang",
                            "rollout.placement=disaggregated", "rollout.num_engines=1", "trainer.max_staleness=1",
                            "algorithm.rollout_correction.rollout_is=token", "model.sft_warm_start.enable=false",
                            "reward.reward_fn=e2e_reward_fns:char_parity", "data.train_batch_size=4",
                            "data.gen_batch_size=8", "trainer.ppo_mini_batch_size=4",
                            "rollout.update_weights_bucket_megabytes=1", "trainer.total_training_steps=1",
                            "trainer.test_freq=100", f"trainer.output_dir={out}")
    tag = uuid.uuid4().hex
    env = {**trainer_env(tmp_path / "cache"), "MEGATRON_DAPO_FAULT": f"{phase}:0:kill", "FAULT_TEST_TAG": tag}
    log = tmp_path / "trainer.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        assert proc.wait(timeout=600) == -9, log.read_text()[-3000:]
        assert f"rank 0: injected fault at the start of {phase}" in log.read_text()
        assert_run_gone(tag, within_s=15)
    finally:
        for pid in run_processes(tag):  # a failing test leaves nothing behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    answered, unanswered = TRAINER_KILL_LOGS[phase]
    text = (out / "engine_logs" / "sglang0.log").read_text(errors="replace")  # in the sync, at the phase named
    assert all(line in text for line in answered) and not any(line in text for line in unanswered), text[-2000:]
