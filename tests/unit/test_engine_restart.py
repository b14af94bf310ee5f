"""A dead or hung engine process is replaced in place (RolloutController, rollout.max_engine_restarts).

The controller restarts the local engine's process from its HF checkpoint, loads the
weights of the last sync into it, and sends again what was lost: with counter-based
seeding every response is then token for token what an engine that never died samples.
Beyond the allowed restarts the failure is one EngineRestartsExhausted naming the engine.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from model_utils import make_tiny_checkpoint
from safetensors.torch import load_file

from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import EngineError, EngineRestartsExhausted, SamplingParams
from megatron_dapo.rollout.fleet.broadcast import FleetSyncError
from megatron_dapo.rollout.local.process import ProcessEngine
from megatron_dapo.rollout.streaming import PromptFeed

PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7, stop_token_ids=tuple(range(0, 100, 9)))
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15], [16, 17], [18]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tie_word_embeddings=True)


@pytest.fixture(scope="module")
def new_weights(tiny):
    """Weights other than the checkpoint's: a restart that reloaded only the checkpoint would differ."""
    tensors = load_file(str(tiny / "model.safetensors"))
    return [(name, t * 1.5 if t.dim() == 2 else t) for name, t in sorted(tensors.items())]


def _controller(tiny, new_weights, max_restarts: int, hang_timeout_s: float = 120.0) -> RolloutController:
    engine = ProcessEngine(tiny, name="proc0", num_threads=1, max_batch_size=4, hang_timeout_s=hang_timeout_s)
    controller = RolloutController([engine], max_restarts=max_restarts)
    controller.update_weights(new_weights)
    controller.finish_weight_update(version=5)
    return controller


def _stream(controller: RolloutController, fault=None) -> dict[int, list]:
    """Stream every prompt; `fault(engine)` runs at the first finished group. Returns prompt -> responses."""
    feed = PromptFeed(iter(PROMPTS))
    groups: dict[int, list] = {}

    def on_group(group):
        index = group[0].prompt_index
        assert index not in groups, f"prompt {index} came back twice"
        groups[index] = [(r.sample_index, r.output_ids, r.weight_versions) for r in group]
        if fault is not None and len(groups) == 1:
            fault(controller.engines[0])

    controller.stream(feed, PARAMS, on_group, max_inflight=3)
    return groups


@pytest.fixture(scope="module")
def clean(tiny, new_weights):
    controller = _controller(tiny, new_weights, max_restarts=0)
    try:
        return _stream(controller), controller.generate(PROMPTS * 8, PARAMS)
    finally:
        controller.shutdown()


def _kill(engine: ProcessEngine) -> None:
    os.kill(engine._process.pid, signal.SIGKILL)


def test_engine_killed_mid_stream_is_restarted_with_the_current_weights(tiny, new_weights, clean):
    controller = _controller(tiny, new_weights, max_restarts=1)
    try:
        got = _stream(controller, fault=_kill)
        assert controller.num_restarts == 1
        # Every prompt exactly once, each response the one the engine that never died sampled
        # (the checkpoint's own weights would sample others: see the last assert).
        assert got == clean[0]
        assert all(versions == (5,) for g in got.values() for _, _, versions in g)
        # And it keeps serving: a round after the restart equals the clean round too.
        again = controller.generate(PROMPTS * 8, PARAMS)
        assert [(r.prompt_index, r.output_ids) for r in again] == [(r.prompt_index, r.output_ids) for r in clean[1]]
        # What a restart that reloaded only the checkpoint would have sampled: other tokens.
        controller.engines[0].restart()
        assert [r.output_ids for r in controller.engines[0].generate(PROMPTS * 8, PARAMS)] != \
            [r.output_ids for r in clean[1]]
    finally:
        controller.shutdown()


def test_engine_killed_during_generate_is_restarted_and_asked_again(tiny, new_weights, clean):
    controller = _controller(tiny, new_weights, max_restarts=2)
    try:
        engine = controller.engines[0]
        # Kill it between two decode steps of the generate call (its between-steps hook is in the child:
        # kill from the controller's side as soon as the call is in flight).
        killer = threading.Timer(0.3, _kill, args=(engine,))
        killer.start()
        got = controller.generate(PROMPTS * 8, PARAMS)
        killer.join()
        assert controller.num_restarts == 1
        assert [(r.prompt_index, r.sample_index, r.output_ids) for r in got] == \
            [(r.prompt_index, r.sample_index, r.output_ids) for r in clean[1]]
    finally:
        controller.shutdown()


def test_a_hung_engine_is_killed_and_replaced(tiny, new_weights, clean):
    # 5 s: a healthy child descheduled on a loaded machine must not look hung (it would take the one restart).
    controller = _controller(tiny, new_weights, max_restarts=1, hang_timeout_s=5.0)
    try:
        got = _stream(controller, fault=lambda engine: os.kill(engine._process.pid, signal.SIGSTOP))
        assert controller.num_restarts == 1
        assert got == clean[0]
    finally:
        controller.shutdown()


def test_without_restarts_a_dead_engine_fails_the_call(tiny, new_weights):
    controller = _controller(tiny, new_weights, max_restarts=0)
    try:
        with pytest.raises(EngineRestartsExhausted) as err:
            _stream(controller, fault=_kill)
        assert isinstance(err.value, EngineError)
        text = str(err.value)
        assert text.startswith("engine proc0 failed (engine proc0: its process (pid ")
        assert "after 0 restart(s) of engines in this run (rollout.max_engine_restarts=0); the run stops here" in text
        assert "\n" not in text
    finally:
        controller.shutdown()


def test_restarts_are_counted_per_run_not_per_failure_site(tiny, new_weights):
    controller = _controller(tiny, new_weights, max_restarts=1)
    try:
        _stream(controller, fault=_kill)
        with pytest.raises(EngineRestartsExhausted, match=r"after 1 restart\(s\) .*max_engine_restarts=1\)"):
            _stream(controller, fault=_kill)
        assert controller.num_restarts == 1
    finally:
        controller.shutdown()


class _Restartable:
    """Just enough of an engine for the controller's weight bookkeeping."""

    name = "fake0"
    log_path = None

    def update_weights(self, bucket):
        pass

    def finish_weight_update(self, version=None):
        pass

    def restart(self):
        pass

    def shutdown(self):
        pass


def test_weights_are_kept_only_when_an_engine_may_restart(new_weights):
    controller = RolloutController([_Restartable()], max_restarts=0)
    controller.update_weights(new_weights)
    controller.finish_weight_update(version=1)
    assert controller._kept.buckets == []
    controller = RolloutController([_Restartable()], max_restarts=1)
    controller.update_weights(new_weights)
    assert controller._kept.buckets == []  # an update in progress is not yet what a restart loads
    controller.finish_weight_update(version=1)
    kept = dict(controller._kept.buckets[0])
    assert torch.equal(kept[new_weights[0][0]], new_weights[0][1])
    assert kept[new_weights[0][0]].data_ptr() != new_weights[0][1].data_ptr()  # a copy, not a view


class _Member(_Restartable):
    restartable = True

    def __init__(self, name):
        self.name, self.loaded, self.restarts, self.stopped = name, [], 0, 0

    def update_weights(self, bucket):
        self.loaded.append([n for n, _ in bucket])

    def restart(self):
        self.restarts += 1

    def shutdown(self):
        self.stopped += 1


class _Broadcast:
    """A fleet transport whose second bucket fails (a member died mid-sync)."""

    def __init__(self):
        self.sent, self.replaced, self.finished, self.reloaded = [], [], [], []

    def update_weights(self, bucket):
        if len(self.sent) == 1:
            raise FleetSyncError("weight broadcast to the fleet failed at the broadcast: fake1 died", ["fake1"])
        self.sent.append(bucket)

    def finish_weight_update(self, version=None):
        self.finished.append(version)

    def engine_replaced(self, index, engine):
        self.replaced.append(index)

    def reload(self, index, buckets, version):
        self.reloaded.append((index, [[n for n, _ in b] for b in buckets], version))

    def close(self):
        pass


def _after_a_failed_sync(transport, new_weights, members=None, max_restarts=4):
    """Members (two by default) and their controller, whose sync of version 7 failed at its second
    bucket (the transport's doing): every member marked and stopped, nothing restarted yet."""
    members = members or [_Member("fake0"), _Member("fake1")]
    controller = RolloutController(members, max_restarts=max_restarts, transport=transport)
    buckets = [new_weights[:1], new_weights[1:2], new_weights[2:]]
    for bucket in buckets:
        controller.update_weights(bucket)
    controller.finish_weight_update(version=7)
    return members, controller, buckets


def test_a_failed_fleet_broadcast_restarts_every_member_with_the_whole_sync(new_weights):
    """Issue 41: after a broken broadcast every member's weights are partly updated, so each is
    restarted (and rejoins: engine_replaced) and loads the kept weights, this sync's included, the
    fleet's way (reload: by broadcast to it alone, never through a member's own update_weights);
    without restarts the one line is raised."""
    transport = _Broadcast()
    members, controller, buckets = _after_a_failed_sync(transport, new_weights)
    assert len(transport.sent) == 1 and transport.finished == []  # the rest of the sync was not sent
    # Stopped at once (paused mid-update, a running stream's requests to them would wait an hour).
    assert [m.stopped for m in members] == [1, 1] and [m.restarts for m in members] == [0, 0]
    controller.restart_failed_engines()
    assert [m.restarts for m in members] == [1, 1] and sorted(transport.replaced) == [0, 1]
    names = [[n for n, _ in b] for b in buckets]
    assert sorted(transport.reloaded) == [(0, names, 7), (1, names, 7)]
    assert [m.loaded for m in members] == [[], []]
    with pytest.raises(FleetSyncError, match="fake1 died"):
        stopped = RolloutController([_Member("fake0"), _Member("fake1")], max_restarts=0, transport=_Broadcast())
        for bucket in buckets:
            stopped.update_weights(bucket)


class _FailsOnce(_Broadcast):
    """A fleet transport whose first sync fails at its second bucket; every later one goes through."""

    def __init__(self):
        super().__init__()
        self.failed = False

    def update_weights(self, bucket):
        if len(self.sent) == 1 and not self.failed:
            self.failed = True
            raise FleetSyncError("weight broadcast to the fleet failed at the broadcast: fake1 died", ["fake1"])
        self.sent.append(bucket)


def test_a_sync_after_a_failed_one_restarts_the_members_no_stream_restarted_and_reaches_them_all(new_weights):
    """Seen in CI 2026-12-04 (a vLLM fleet, a kill in the broadcast while a stream ran): the stream's
    threads restarted only the member they met dead; the other stayed marked, and the next sync,
    seeing a marked member, sent nothing to the fleet: the restarted member kept serving the older
    version, past the staleness bound once the producer ran ahead. A sync's first piece now
    restarts the marked members first, and the sync reaches every member. A restart asked for a
    life already replaced (the stream's, after the sync's start restarted it) does nothing."""
    transport = _FailsOnce()
    members, controller, first = _after_a_failed_sync(transport, new_weights)
    assert controller.sync_failed and transport.finished == []
    controller._restart(1, EngineError("fake1 died"), life=0)  # the stream's thread met fake1 dead
    assert [m.restarts for m in members] == [0, 1] and controller.sync_failed  # fake0 still marked
    second = [new_weights[:2], new_weights[2:]]
    for bucket in second:
        controller.update_weights(bucket)
    controller.finish_weight_update(version=8)
    assert [m.restarts for m in members] == [1, 1] and not controller.sync_failed
    names = [[n for n, _ in b] for b in first]
    assert sorted(transport.reloaded) == [(0, names, 7), (1, names, 7)]  # each loaded the kept version 7
    assert [[n for n, _ in b] for b in transport.sent[1:]] == [[n for n, _ in b] for b in second]
    assert transport.finished == [8]  # version 8 reached the whole fleet
    controller._restart(0, EngineError("fake0: its weight update failed"), life=0)  # a stale ask
    assert [m.restarts for m in members] == [1, 1] and controller.num_restarts == 2


class _Slow(_Member):
    """A member whose restart waits for `go` (a relaunch takes a minute)."""

    def __init__(self, name, go):
        super().__init__(name)
        self.go, self.restarting = go, threading.Event()

    def restart(self):
        self.restarting.set()
        assert self.go.wait(timeout=30)
        super().restart()


@pytest.mark.parametrize("start", ["before the export", "at the first bucket"])
def test_a_death_met_by_a_stream_and_a_syncs_start_is_one_restart_and_spends_the_budget_once(new_weights, start):
    """Review of the fix above: the stream's thread and the sync's start both restart a marked
    member. Each took a unit of the budget before either restart ended, so with
    max_restarts=2 and two deaths the second taker raised EngineRestartsExhausted although two
    restarts were all that happened. Then (a second review) the first bucket's restart, holding
    the weights lock, waited for the stream's, which waited for that lock: a deadlock. Restarts
    now run one at a time under the weights lock, and a life already replaced is left alone."""
    from megatron_dapo.rollout.engine import EngineRestartsExhausted

    go = [threading.Event(), threading.Event()]
    members, controller, _ = _after_a_failed_sync(_FailsOnce(), new_weights,
                                                  [_Slow("fake0", go[0]), _Slow("fake1", go[1])], max_restarts=2)
    assert controller.sync_failed
    errors: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except BaseException as err:  # the test reads it
            errors.append(err)

    def first_bucket():  # the next sync: its first piece restarts what is still marked
        controller.update_weights(new_weights[:1])
        controller.finish_weight_update(version=8)

    entry = controller.restart_failed_engines if start == "before the export" else first_bucket
    sync_start = threading.Thread(target=run, args=(entry,), daemon=True)
    sync_start.start()
    assert members[0].restarting.wait(timeout=30)  # the sync's start is restarting fake0
    stream = threading.Thread(target=run, args=(lambda: controller._restart(1, EngineError("fake1 died"), life=0),),
                              daemon=True)
    stream.start()  # the stream's thread met fake1 dead meanwhile
    time.sleep(0.3)
    go[0].set()
    time.sleep(0.3)  # the sync's start reaches fake1 while the stream's restart of it is under way
    go[1].set()
    sync_start.join(timeout=30)
    stream.join(timeout=30)
    assert not sync_start.is_alive() and not stream.is_alive()
    assert not [e for e in errors if isinstance(e, EngineRestartsExhausted)], errors
    assert not errors, errors
    assert [m.restarts for m in members] == [1, 1] and controller.num_restarts == 2 and not controller.sync_failed


class _Server:
    """A fake server engine: one request per prompt; with `dies`, its first request fails (the
    prompt is recorded in `lost`) and it stays dead until restarted."""

    def __init__(self, name, dies=False, restart_gate=None):
        self.name, self.dies, self.restart_gate, self.log_path = name, dies, restart_gate, None
        self.served, self.lost, self.restarts, self.dead = [], [], 0, False

    def generate(self, prompts, params, *, index_offset=0):
        from megatron_dapo.rollout.engine import GenerationResult

        if self.dead or self.dies:
            if self.dies:
                self.lost.append(index_offset)
            self.dead, self.dies = True, False
            raise EngineError(f"engine {self.name}: its server died")
        time.sleep(0.05)  # both engines take prompts from the feed
        self.served.append(index_offset)
        return [GenerationResult(prompt_index=index_offset, sample_index=j, output_ids=[1], logprobs=[-0.5],
                                 finish_reason="length", weight_versions=(4,)) for j in range(params.n)]

    def restart(self):
        # Like a server relaunch (a minute): the fleet serves the dead one's prompts meanwhile.
        if self.restart_gate is not None:
            assert self.restart_gate.wait(timeout=30), "the dead engine's prompt was not served while it restarted"
        self.restarts, self.dead = self.restarts + 1, False

    def abort(self):
        if self.dead:
            raise EngineError(f"engine {self.name}: was killed by SIGKILL")

    def clear_abort(self):
        pass

    def update_weights(self, bucket):
        pass

    def finish_weight_update(self, version=None):
        pass


def test_a_dead_engines_prompts_go_to_the_others_while_it_restarts_and_an_abort_does_not_charge_them():
    """Issue 41 (seen on a vLLM fleet of two): the dead engine's prompts were requeued only after its
    minute-long restart, so the feed's gate idled the survivor; and the batch's abort, sent from the
    survivor's thread, raised the dead engine's error there, so the survivor was restarted too."""
    served_elsewhere = threading.Event()
    dying = _Server("srv1", dies=True, restart_gate=served_elsewhere)
    survivor = _Server("srv0")
    controller = RolloutController([survivor, dying], max_restarts=2)
    feed = PromptFeed(iter([[i + 1] for i in range(6)]))
    groups = {}

    def on_group(group):
        groups[group[0].prompt_index] = group
        if dying.lost and dying.lost[0] in survivor.served:
            served_elsewhere.set()
        if len(groups) == 5:
            feed.close()
            controller.abort()  # from the survivor's thread, while the dying engine is down

    controller.stream(feed, SamplingParams(n=2, max_new_tokens=1), on_group, max_inflight=1)
    assert dying.lost and dying.lost[0] in survivor.served, "the dead engine's prompt waited for its restart"
    assert (survivor.restarts, dying.restarts) == (0, 1) and controller.num_restarts == 1


def test_a_continued_response_keeps_the_versions_of_both_parts():
    """A response cut with no tokens (vLLM 0.32's abort) and continued under version 5 reports (5,);
    one cut under 3 and continued under 4 reports (3, 4), oldest first."""
    from megatron_dapo.rollout.engine import GenerationResult
    from megatron_dapo.rollout.streaming import continuation

    def result(tokens, versions, reason="abort"):
        return GenerationResult(prompt_index=0, sample_index=1, output_ids=tokens, logprobs=[-0.1] * len(tokens),
                                finish_reason=reason, weight_versions=versions)

    assert continuation(result([], ()), result([7, 8], (5,), "stop")).weight_versions == (5,)
    assert continuation(result([1], (3,)), result([7], (4,), "length")).weight_versions == (3, 4)


class _Relaunching(_Server):
    """A server that dies at its first request and whose relaunch takes until `relaunched` is set."""

    def __init__(self, name):
        super().__init__(name, dies=True)
        self.relaunching, self.relaunched, self.stops = threading.Event(), threading.Event(), 0

    def restart(self):
        self.relaunching.set()
        assert self.relaunched.wait(timeout=30)
        self.restarts, self.dead = self.restarts + 1, False

    def shutdown(self):
        self.stops += 1


def _stream_in_thread(controller: RolloutController) -> tuple[threading.Thread, list[BaseException]]:
    """Stream four prompts on a thread of its own; the list receives what the stream raised."""
    feed = PromptFeed(iter([[i + 1] for i in range(4)]))
    failure: list[BaseException] = []

    def stream():
        try:
            controller.stream(feed, SamplingParams(n=1, max_new_tokens=1), lambda group: None, max_inflight=1)
        except BaseException as err:
            failure.append(err)

    streaming = threading.Thread(target=stream, daemon=True)
    streaming.start()
    return streaming, failure


def test_shutdown_does_not_wait_for_a_stream_whose_engine_is_relaunching():
    """Seen 2026-11-29 (a SLURM vLLM fleet that failed at step 4 never exited): the run's close
    stopped the engines on the controller's pool, whose one worker was the stream still waiting for
    a minute-long relaunch, so the stop waited behind it. Now shutdown stops the engine at once, and
    the relaunch that ends after it stops its fresh server and restarts nothing more."""
    engine = _Relaunching("srv0")
    controller = RolloutController([engine], max_restarts=3)
    streaming, failure = _stream_in_thread(controller)
    assert engine.relaunching.wait(timeout=30)
    stopping = threading.Thread(target=controller.shutdown, daemon=True)
    stopping.start()
    stopping.join(timeout=5)
    assert not stopping.is_alive(), "shutdown waited for the relaunch"
    assert engine.stops == 1
    engine.relaunched.set()
    streaming.join(timeout=30)
    assert not streaming.is_alive()
    assert engine.stops == 2, "the server relaunched during shutdown was not stopped"
    assert len(failure) == 1 and isinstance(failure[0], EngineError), failure
    assert "shut down while it restarted" in str(failure[0])
    assert engine.restarts == 1 and controller.num_restarts == 1


def test_a_restart_queued_behind_another_is_not_started_after_shutdown():
    """Two engines die together (a failed broadcast stops every server): their restarts take turns
    on the weights lock. A shutdown while the first relaunches must not let the second start a
    relaunch of its own afterwards (each up to its start-up timeout, one after the other)."""
    first, second = _Relaunching("srv0"), _Relaunching("srv1")
    controller = RolloutController([first, second], max_restarts=4)
    streaming, failure = _stream_in_thread(controller)
    deadline = time.monotonic() + 30
    while not (first.relaunching.is_set() or second.relaunching.is_set()):
        assert time.monotonic() < deadline, "no relaunch began"
        time.sleep(0.01)
    running, queued = (first, second) if first.relaunching.is_set() else (second, first)
    while not queued.lost:  # the other engine died too: its thread asks for a restart and waits for the lock
        assert time.monotonic() < deadline, "the second engine did not die"
        time.sleep(0.01)
    time.sleep(0.2)
    assert controller.num_restarts == 1  # counted under the lock, once its turn comes: not yet
    controller.shutdown(timeout_s=10)
    running.relaunched.set()
    queued.relaunched.set()  # were it relaunched anyway, it would not block the test
    streaming.join(timeout=30)
    assert not streaming.is_alive()
    assert not queued.relaunching.is_set(), "a restart began after shutdown"
    assert queued.restarts == 0 and running.restarts == 1
    assert controller.num_restarts == 1, "a restart refused at shutdown was counted"
    assert failure and isinstance(failure[0], EngineError), failure


class _Versioned(_Restartable):
    """A fleet member that labels its tokens with the version its last finished update set."""

    restartable = True

    def __init__(self):
        self.version = None


class _VersionBroadcast:
    """A fleet transport that records what reaches the member, and when."""

    def __init__(self, member):
        self.member, self.events = member, []

    def update_weights(self, bucket):
        self.events.append(("bucket", [n for n, _ in bucket]))

    def finish_weight_update(self, version=None):
        self.events.append(("finish", version))
        self.member.version = version

    def engine_replaced(self, index, engine):
        self.events.append(("replaced", index))

    def reload(self, index, buckets, version):
        self.events.append(("reload", version))
        self.member.version = version


def test_a_restart_during_a_sync_waits_for_it_and_loads_the_new_version(new_weights):
    """Seen under CI load (a SLURM vLLM fleet, 2026-11-29): the server died while the trainer synced
    version 2. Its restart took the weights lock between the sync's last bucket and its finish,
    loaded version 1's kept weights and label, and the sync's finish then found nothing to finish on
    the fresh server: it served version 2's batches as version 1, and step 4 raised a StalenessError.
    The restart now waits for the whole sync, from its first bucket to its finish."""
    from megatron_dapo.rollout.weight_sync import sync_weights

    member = _Versioned()
    transport = _VersionBroadcast(member)
    controller = RolloutController([member], max_restarts=2, transport=transport)
    controller.update_weights(new_weights)
    controller.finish_weight_update(version=1)
    transport.events.clear()
    exported, go = threading.Event(), threading.Event()

    def export():  # every tensor a bucket of its own; the export pauses after the first was sent
        yield new_weights[0]
        yield new_weights[1]
        exported.set()
        assert go.wait(timeout=30)

    syncing = threading.Thread(target=sync_weights, args=(export(), [controller]),
                               kwargs=dict(is_controller=True, bucket_bytes=1, version=2), daemon=True)
    syncing.start()
    assert exported.wait(timeout=30)
    restarting = threading.Thread(target=controller._restart, args=(0, EngineError("srv0 died")),
                                  kwargs=dict(life=0), daemon=True)
    restarting.start()
    restarting.join(timeout=0.5)
    assert restarting.is_alive(), "the restart did not wait for the sync in progress"
    go.set()
    syncing.join(timeout=30)
    restarting.join(timeout=30)
    assert not syncing.is_alive() and not restarting.is_alive()
    names = [n for n, _ in new_weights[:2]]
    assert transport.events == [("bucket", names[:1]), ("bucket", names[1:]), ("finish", 2), ("replaced", 0),
                                ("reload", 2)], transport.events
    assert member.version == 2
    assert [[n for n, _ in b] for b in controller._kept.buckets] == [names[:1], names[1:]]


def test_an_abort_ends_a_stream_whose_feed_the_collector_left_open():
    """Seen with the SLURM fleet (2026-11-29): the trainer failed while the producer streamed, and
    stopping the producer aborted the engines without closing the collector's feed. Each request
    sent after the abort ended at once as aborted, its prompt counted in flight, the collector's
    gate shut for good, and the stream's threads (joined at interpreter exit) never ended."""
    engine = _Server("srv0")
    controller = RolloutController([engine], max_restarts=0)
    aborted = threading.Event()

    def generate(prompts, params, *, index_offset=0):
        from megatron_dapo.rollout.engine import GenerationResult

        if not aborted.is_set():
            time.sleep(0.05)
        reason = "abort" if aborted.is_set() else "length"
        return [GenerationResult(prompt_index=index_offset, sample_index=j, output_ids=[1], logprobs=[-0.5],
                                 finish_reason=reason) for j in range(params.n)]

    engine.generate = generate
    engine.abort = aborted.set
    feed = PromptFeed(iter([[i + 1] for i in range(10_000)]), gate=lambda taken: taken - len(groups) < 4)
    groups = []
    result = []

    def stream():
        result.append(controller.stream(feed, SamplingParams(n=2, max_new_tokens=1), groups.append, max_inflight=2))

    streaming = threading.Thread(target=stream, daemon=True)
    streaming.start()
    deadline = time.monotonic() + 30
    while len(groups) < 3:
        assert time.monotonic() < deadline and streaming.is_alive()
        time.sleep(0.01)
    controller.abort()  # as stop_producer does: the collector's feed stays open
    streaming.join(timeout=10)
    try:
        assert not streaming.is_alive(), "the stream went on after the abort"
        assert result and all(r.finish_reason == "abort" for r in result[0])
    finally:
        feed.close()
