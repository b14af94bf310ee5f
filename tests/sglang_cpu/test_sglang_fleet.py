"""A fleet of SGLang servers fed by broadcast (issue 41, rollout/fleet/broadcast.py), on CPU over gloo.

Two real servers join one group with the controller; every bucket goes once, as bytes, to
both. The tests hold the weights (both serve checkpoint b's log-probs and the same version
after the sync) and the deadlines: a server killed before the group forms, between two buckets
of one sync and before the finish ends the sync with one line naming it, well inside the
deadline, and the fleet syncs again once it is restarted (one run kills at the three phases in
turn). A trainer SIGKILLed in its first sync (at init and finish; a stage source killed mid-broadcast
leaves the server where the metadata phase did) leaves no server process behind. Before them, on the first
server alone: a weight update mid-row (the in-place pause) and the controller's restart of a server
killed mid-generate (each had a server of its own: two SGLang starts more in CI).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from proc_utils import alive
from safetensors.torch import load_file
from test_sglang_server import PROMPTS, SHAPE, decode_lines, make_checkpoint, wait_decoding
from tiers import requires, sglang_missing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from trainer_utils import REPO, assert_run_gone, run_processes, train_command, trainer_env

from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.fleet.broadcast import FleetSyncError, WeightBroadcast
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import SGLangServerConfig
from megatron_dapo.rollout.weight_sync import iter_buckets

pytestmark = [
    pytest.mark.sglang_cpu,
    *requires(sglang_missing()),
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


# --- One server of the fleet, before the broadcast tests: the in-place pause, the controller's restart.

MID_ROW_TOKENS = 1500  # long enough that the update lands mid-row on 2 cores


def test_an_update_mid_row_pauses_in_place_and_the_row_spans_both_versions(fleet, checkpoints):
    """DESIGN.md "The asynchronous loop": a weight update pauses generation in place, loads the
    buckets, sets the version and continues; the row in flight is neither aborted nor waited for
    and reports both versions (a 0.5.18 update without the pause waits for every request in
    flight: the model's writer lock). On the module's first server (its own server cost CI a start)."""
    import json
    import threading

    import torch
    from model_utils import hf_log_probs

    old, new = checkpoints
    engine = fleet[0]
    engine.update_weights(sorted(load_file(str(old / "model.safetensors")).items()))
    engine.finish_weight_update(version=0)
    out: dict = {}

    def run() -> None:
        out["results"] = engine.generate([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=MID_ROW_TOKENS, seed=3))
        out["done_s"] = time.monotonic()

    since = decode_lines(engine)
    thread = threading.Thread(target=run)
    thread.start()
    # Two decode lines after the send: 40 decode steps apart (SGLang's decode_log_interval), so more than
    # the 10 tokens checked below came under the old weights.
    wait_decoding(engine, since + 1, thread)
    start = time.monotonic()
    engine.update_weights(sorted(load_file(str(new / "model.safetensors")).items()))
    engine.finish_weight_update(version=1)
    update_s = time.monotonic() - start
    assert thread.is_alive(), "the row finished before the update: raise MID_ROW_TOKENS"
    thread.join(timeout=120)
    results = out["results"]
    print(json.dumps({"update_s": round(update_s, 2), "row_end_after_update_s": round(out["done_s"] - start, 2)}))
    assert [(r.finish_reason, len(r.output_ids), r.weight_versions) for r in results] == \
        [("length", MID_ROW_TOKENS, (0, 1))] * 2
    # The first tokens are the old weights' log-probs, the last ones are not: the row went on
    # under the new weights with its KV cache.
    tokens = torch.tensor([[1, 2, 3, *results[0].output_ids]])
    under_old = hf_log_probs(old, tokens)[0, 2:-1].gather(-1, tokens[0, 3:, None])[:, 0]
    engine_lp = torch.tensor(results[0].logprobs)
    assert (engine_lp[:10] - under_old[:10]).abs().max() < 1e-4
    assert (engine_lp[-10:] - under_old[-10:]).abs().max() > 1e-2
    after = engine.generate([[4, 5, 6]], SamplingParams(n=1, max_new_tokens=8, seed=4))
    assert after[0].weight_versions == (1,)
    tokens = torch.tensor([[4, 5, 6, *after[0].output_ids]])
    under_new = hf_log_probs(new, tokens)[0, 2:-1].gather(-1, tokens[0, 3:, None])[:, 0]
    assert (torch.tensor(after[0].logprobs) - under_new).abs().max() < 1e-4


RESTART_PROMPTS = [[i % 90 + 1, 7, (3 * i) % 50 + 1] for i in range(8)]
# 32 rows of 320 tokens: ~3 s of decoding on this 2-core machine; the kill comes 0.2 s after the
# send, so it lands while the /generate is in flight (a kill 1 s after 160 tokens came too late in CI).
RESTART_TOKENS = 320
RESTART_VERSION = 3


def test_a_server_killed_mid_generate_is_restarted_by_the_controller_with_the_synced_weights(fleet, checkpoints):
    """Issue 31: a server the controller launched, SIGKILLed (its process group) while the
    controller's /generate runs, is relaunched with the same resolved settings (port, key, log
    appended), loaded with the last sync's weights and version, and asked again: every response
    comes at that version with the synced weights' log-probs, one restart is counted, and the
    dead server's /dev/shm files are gone. The colocated path: the controller hands the kept
    buckets to the restarted server itself (a fleet's broadcast reload is the trainer run's)."""
    import threading

    import torch
    from model_utils import reference_log_probs

    engine = fleet[0]
    started, synced = checkpoints
    controller = RolloutController([engine], max_restarts=1)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=RESTART_TOKENS, seed=5)
    controller.update_weights(sorted(load_file(str(synced / "model.safetensors")).items()))
    controller.finish_weight_update(version=RESTART_VERSION)
    old_pid, old_url = engine.process.pid, engine.base_url
    old_files = {p for p in engine.process.shared_memory_files if Path(p).name.startswith("sglang_loads_")}
    assert old_files, "the server held no sglang_loads_* file: nothing to check"
    starts_before = Path(engine.log_path).read_text(errors="replace").count("server_args=ServerArgs(")

    sent = threading.Event()
    request = engine._request

    def watching(method, path, *args, **kwargs):
        if path == "/generate":
            sent.set()
        return request(method, path, *args, **kwargs)

    engine._request = watching  # kept by restart(): it updates the instance's attributes
    killed_running: list[bool] = []

    def kill() -> None:
        sent.wait(timeout=120)
        time.sleep(0.2)
        killed_running.append(engine.process.returncode is None and bool(engine._inflight))
        os.killpg(old_pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        results = controller.generate(RESTART_PROMPTS, params)
    finally:
        killer.join()
        engine._request = request
    assert killed_running == [True], "the /generate had returned before the kill"
    assert controller.num_restarts == 1
    assert engine.process.pid != old_pid and engine.process.returncode is None
    assert engine.base_url == old_url  # the same resolved config: clients of other ranks stay valid
    assert [(r.prompt_index, r.sample_index) for r in results] == [(i, j) for i in range(8) for j in range(4)]
    assert all(r.finish_reason == "length" and len(r.output_ids) == RESTART_TOKENS for r in results)
    # Reloaded with the version: the engine's check of every answer's version passed.
    assert {r.weight_versions for r in results} == {(RESTART_VERSION,)}
    assert not any(os.path.exists(p) for p in old_files), sorted(p for p in old_files if os.path.exists(p))
    assert Path(engine.log_path).read_text(errors="replace").count("server_args=ServerArgs(") == starts_before + 1
    diffs, stale = [], []
    for r in results[::11]:
        got = torch.tensor(r.logprobs)
        prompt = RESTART_PROMPTS[r.prompt_index]
        diffs.append((got - reference_log_probs(synced, prompt, r.output_ids, 1.0)).abs())
        stale.append((got - reference_log_probs(started, prompt, r.output_ids, 1.0)).abs())
    assert torch.cat(diffs).max().item() < 1e-4
    assert torch.cat(stale).mean().item() > 1e-2


def test_a_server_owned_by_another_rank_fails_without_a_restart():
    """A client of a server that another rank owns is not restartable: its failure is the usual
    EngineError naming the owner, no restart counted."""
    from megatron_dapo.launcher import free_port
    from megatron_dapo.rollout.engine import EngineError, EngineRestartsExhausted

    client = SGLangEngine(f"http://127.0.0.1:{free_port('127.0.0.1')}", name="sglang1", api_key="key",
                          log_location="node1:/run/sglang1.log (owned by rank 2)")
    controller = RolloutController([client], max_restarts=1)
    try:
        with pytest.raises(EngineError) as info:
            controller.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=4))
        assert not isinstance(info.value, EngineRestartsExhausted) and controller.num_restarts == 0
        assert "SGLang engine sglang1" in str(info.value) and "owned by rank 2" in str(info.value)
        with pytest.raises(EngineError, match="another rank owns its server"):
            client.restart()
    finally:
        controller.shutdown()


# --- The fleet's broadcast.


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
        # A group formed again (as after a restart: here with the same servers) is the only one the
        # servers hold: each destroys the old one first (fleet/broadcast.py _leave_stale).
        left = 'POST /destroy_weights_update_group HTTP/1.1" 200'
        before = [Path(e.log_path).read_text(errors="replace").count(left) for e in fleet]
        broadcast.engine_replaced(1, fleet[1])
        sync(rollout, checkpoints[1], version=5)
        assert [Path(e.log_path).read_text(errors="replace").count(left) for e in fleet] == [n + 1 for n in before]
        assert {r.weight_versions for e in fleet for r in e.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=2))} \
            == {(5,)}
    finally:
        broadcast.close()


def test_two_pipeline_stages_each_broadcast_their_own_buckets_in_groups_of_their_own(fleet, checkpoints):
    """Issue 41 item 2 (fleet/stages.py): stage 0's buckets in the controller's group, stage 1's
    broadcast by its own first rank, rank 0 of a second group SGLang keeps beside the first (by
    name); the controller, rank 1 there, keeps every tensor for restarts."""
    from fleet_utils import kept_equal, split_stages, sync_two_stages
    from model_utils import sampled_gaps

    broadcast = WeightBroadcast(fleet, master_address="127.0.0.1", backend="gloo", timeout_s=DEADLINE_S)
    rollout = RolloutController(fleet, transport=broadcast, max_restarts=1)
    try:
        stage0, stage1 = split_stages(buckets(checkpoints[1]))
        sync_two_stages(rollout, checkpoints[1], stage0, stage1, version=5)
        for engine in fleet:
            results = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=1))
            assert {r.weight_versions for r in results} == {(5,)}
            assert float(sampled_gaps(checkpoints[1], PROMPTS, results, 1.0).max()) < 5e-5
            assert float(sampled_gaps(checkpoints[0], PROMPTS, results, 1.0).max()) > 1e-2
        assert kept_equal(rollout, buckets(checkpoints[1]))
        assert rollout.prepare_stage_groups(2) is None  # the groups hold every server
        sync(rollout, checkpoints[0], version=6)  # and the controller's group still serves alone
    finally:
        broadcast.close()


def _killed_in_the_sync(broadcast: WeightBroadcast, victim: SGLangEngine, checkpoint: Path, phase: str) -> None:
    """Kill `victim` at `phase` of a sync of `checkpoint`: the sync ends with one FleetSyncError line
    naming it, well inside the deadline (it noticed, not waited), and the victim's processes are gone."""
    pgid = victim.process.pid
    start = time.monotonic()
    with pytest.raises(FleetSyncError) as caught:
        if phase == "finish":
            for bucket in buckets(checkpoint):
                broadcast.update_weights(bucket)
            os.killpg(pgid, signal.SIGKILL)
            broadcast.finish_weight_update(2)
        else:
            sync(broadcast, checkpoint, version=2, kill_before=0 if phase == "group" else 1, victim=victim)
    elapsed = time.monotonic() - start
    message = str(caught.value)
    assert victim.name in caught.value.engines and victim.name in message and "\n" not in message, message
    assert elapsed < DEADLINE_S / 2, f"{phase}: {elapsed:.0f} s, near the deadline: it waited instead of noticing"
    assert not alive(pgid)


def _serve_version(engines: list[SGLangEngine], version: int) -> None:
    assert {r.weight_versions for e in engines for r in e.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=2))} \
        == {(version,)}


def test_a_server_killed_during_the_sync_ends_it_in_one_line_naming_it(fleet, checkpoints):
    """A server SIGKILLed before the group forms, between two buckets and before the finish, in one
    run on the module's two servers (three tests of a phase each restarted the victim twice: an
    SGLang start each, DESIGN.md "How the suite fits CI's budget"). Before the group: sglang1, then
    restarted in place (its /dev/shm files removed), it rejoins a new group and the fleet syncs
    again. Between buckets: sglang1 again, the blame picking it out of two members; the survivor,
    whose broadcast broke mid-bucket, then syncs in a new group of its own and serves that version.
    Before the finish: sglang0, in that group."""
    first, victim = fleet
    broadcast = WeightBroadcast(fleet, master_address="127.0.0.1", backend="gloo", timeout_s=DEADLINE_S)
    try:
        owned = victim.process.shared_memory_files  # noted from its process tree once healthy
        _killed_in_the_sync(broadcast, victim, checkpoints[1], "group")
        victim.restart()
        # A server killed -9 leaves its /dev/shm files: the restart's stop removed them.
        assert [f for f in owned if Path(f).exists()] == [], owned
        broadcast.engine_replaced(1, victim)
        sync(broadcast, checkpoints[0], version=5)
        _serve_version(fleet, 5)
        _killed_in_the_sync(broadcast, victim, checkpoints[1], "between buckets")  # the group exists
    finally:
        broadcast.close()
    alone = WeightBroadcast([first], master_address="127.0.0.1", backend="gloo", timeout_s=DEADLINE_S)
    try:
        sync(alone, checkpoints[0], version=6)
        _serve_version([first], 6)
        _killed_in_the_sync(alone, first, checkpoints[1], "finish")
    finally:
        alone.close()


def _start_faulted_trainer(tmp_path: Path, fault: str, *overrides: str, nproc: int = 1):
    """The tiny run on a fleet of one SGLang server (two cost a minute more of CI for the three
    phases; the vLLM fleet's kill has two), the scratch model with a verifier that needs no skill,
    one small step, MEGATRON_DAPO_FAULT=`fault`: (its process, its log, its output dir, its tag)."""
    out = tmp_path / "run"
    command = train_command(REPO / "examples" / "tiny_cpu.yaml", "rollout.engine=sglang",
                            "rollout.placement=disaggregated", "rollout.num_engines=1", "trainer.max_staleness=1",
                            "algorithm.rollout_correction.rollout_is=token", "model.sft_warm_start.enable=false",
                            "reward.reward_fn=e2e_reward_fns:char_parity", "data.train_batch_size=4",
                            "data.gen_batch_size=8", "trainer.ppo_mini_batch_size=4",
                            "rollout.update_weights_bucket_megabytes=1", "trainer.total_training_steps=1",
                            "trainer.test_freq=100", f"trainer.output_dir={out}", *overrides, nproc=nproc)
    tag = uuid.uuid4().hex
    env = {**trainer_env(tmp_path / "cache"), "MEGATRON_DAPO_FAULT": fault, "FAULT_TEST_TAG": tag}
    log = tmp_path / "trainer.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log, out, tag


TRAINER_KILL_LOGS = {
    # phase: (answered in both servers' logs, not answered in either). fleet_metadata (the server
    # waiting in a broadcast whose sender is gone, its trainer dead) is held by the stage-source
    # kill below, which leaves the server there too: a trainer start and an SGLang start fewer.
    "fleet_init": ((), ('POST /init_weights_update_group HTTP/1.1" 200',)),
    "fleet_finish": (('POST /update_weights_from_distributed HTTP/1.1" 200',), ()),
}


@pytest.mark.parametrize("phase", sorted(TRAINER_KILL_LOGS))
def test_a_trainer_killed_in_a_fleet_sync_takes_its_fleet_with_it(tmp_path, phase):
    """Issue 41: the controller SIGKILLed (MEGATRON_DAPO_FAULT=<phase>:0:kill, no cleanup runs) in
    its first sync: the servers asked to join its group or asked to finish (waiting in a broadcast:
    the stage-source kill below; the vLLM fleet's test kills the controller in the broadcast itself).
    Nothing hangs: every process the run started (the server and its scheduler and detokenizer
    processes) is gone within 15 s, by the servers' reaper (lifetime.py)."""
    proc, log, out, tag = _start_faulted_trainer(tmp_path, f"{phase}:0:kill")
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


def test_a_stage_source_killed_mid_broadcast_ends_the_job_in_one_line_and_takes_its_fleet_with_it(tmp_path):
    """Issue 41 with one broadcast group per pipeline stage (fleet/stages.py): the actor at PP 2 on
    two ranks, rank 1 (stage 1's first rank, the source of its own group) SIGKILLed once its first
    broadcast began (the run's first sync, before step 1), the controller and the server waiting in
    it. The job ends within a bound, far below the groups' deadline (rollout.fleet_sync_timeout_s):
    torchrun names rank 1 and its signal as the root cause and stops rank 0 (before fit, rank 0 has
    no SIGTERM handler of its own, so it ends by the signal; in fit it would print its "stopped"
    line, tests/e2e/test_rank_faults.py), and every process the run started, the server's
    included, is gone. (Which member the controller's FleetSyncError names, the gone source and not
    the servers' echo of it, is held by tests/unit/test_fleet_blame.py: here torchrun's SIGTERM
    usually ends rank 0 before it logs.) It also holds what the controller killed at fleet_metadata
    held (a test of its own until 2026-12-02): the server waits in a broadcast whose sender is gone
    when its trainer dies without cleanup (rank 0 ends by torchrun's SIGTERM, which it has no
    handler for yet), and its reaper takes it."""
    proc, log, out, tag = _start_faulted_trainer(tmp_path, "broadcast:1:kill", "parallel.pipeline_model_parallel_size=2",
                                                 nproc=2)
    try:
        deadline = time.monotonic() + 600
        while "rank 1: injected fault at the start of broadcast" not in log.read_text():
            assert proc.poll() is None, f"the job ended (rc {proc.returncode}) before the fault:\n" + \
                log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        fault_at = time.monotonic()
        rc = proc.wait(timeout=DEADLINE_S)
        elapsed = time.monotonic() - fault_at
        text = log.read_text()
        assert rc == 1, text[-3000:]  # torchrun's own code when a worker failed
        assert elapsed < DEADLINE_S and "[rank0]: Traceback" not in text, text[-4000:]
        root = text.split("Root Cause (first observed failure):")[1].split("=====")[0]
        assert "rank      : 1 (local_rank: 1)" in root and "Signal 9" in root, root
        assert_run_gone(tag, within_s=15)
        print(f"the job ended {elapsed:.1f} s after the kill")
    finally:
        for pid in run_processes(tag):  # a failing test leaves nothing behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    # The server had joined both groups (the controller's, stage 1's) and taken stage 0's buckets.
    text = (out / "engine_logs" / "sglang0.log").read_text(errors="replace")
    assert text.count('POST /init_weights_update_group HTTP/1.1" 200') == 2, text[-2000:]
    assert 'POST /update_weights_from_distributed HTTP/1.1" 200' in text, text[-2000:]
