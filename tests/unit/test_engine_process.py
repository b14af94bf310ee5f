"""The local engine in its own process (rollout.placement=disaggregated on CPU).

The child computes what the in-process engine computes (same model, one thread each), its
stream stops where the in-process one stops, weight buckets sent while it decodes land
between two decode steps and tag the responses with their versions, and a dead child or
a failing callback surfaces as an error instead of a hang.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from model_utils import make_tiny_checkpoint

from megatron_dapo.rollout.engine import EngineError, SamplingParams
from megatron_dapo.rollout.local.engine import LocalEngine
from megatron_dapo.rollout.local.process import ProcessEngine
from megatron_dapo.rollout.streaming import PromptFeed

PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7, stop_token_ids=tuple(range(0, 100, 9)))
"""Stop tokens make lengths differ (the random model never ends on its own), so streams cut rows short."""
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tie_word_embeddings=True)


@pytest.fixture(scope="module")
def child(tiny):
    engine = ProcessEngine(tiny, name="proc0", num_threads=1, max_batch_size=4)
    yield engine
    engine.shutdown()


@pytest.fixture
def local(tiny):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the child's thread count: the same float results
    yield LocalEngine(tiny, name="ref", max_batch_size=4)
    torch.set_num_threads(threads)


def _key(results):
    return [(r.prompt_index, r.sample_index, r.output_ids, r.finish_reason) for r in results]


def test_generate_in_the_child_matches_the_in_process_engine(child, local):
    got = child.generate(PROMPTS, PARAMS, index_offset=3)
    want = local.generate(PROMPTS, PARAMS, index_offset=3)
    assert _key(got) == _key(want)
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-6)
        assert g.weight_versions == w.weight_versions == (0,)
    assert child.health() is True


def _stream(engine, stop_after: int):
    """Stream PROMPTS; the callback closes the feed and aborts once `stop_after` groups came."""
    feed = PromptFeed(iter(PROMPTS))
    groups = []

    def on_group(group):
        groups.append(group)
        if len(groups) == stop_after:
            feed.close()
            engine.abort()

    incomplete = engine.stream(feed, PARAMS, on_group, max_inflight=2)
    return groups, incomplete, feed.num_taken


def test_stream_stops_where_the_in_process_engine_stops(child, local):
    got_groups, got_cut, got_taken = _stream(child, stop_after=2)
    want_groups, want_cut, want_taken = _stream(local, stop_after=2)
    assert [_key(g) for g in got_groups] == [_key(g) for g in want_groups]
    assert _key(got_cut) == _key(want_cut) and got_taken == want_taken
    assert any(r.finish_reason == "abort" for r in got_cut)


def test_weights_sent_mid_stream_land_between_steps_and_tag_the_responses(tiny, child, local):
    new_state = {k: v + 0.01 * torch.randn_like(v) for k, v in local.model.state_dict().items()}
    sent = threading.Event()
    feed = PromptFeed(iter(PROMPTS * 3))
    groups = []

    def update():  # the trainer's thread, while the child decodes
        child.update_weights(list(new_state.items()))
        child.finish_weight_update(version=5)
        sent.set()

    def on_group(group):
        groups.append(group)
        if len(groups) == 1:
            threading.Thread(target=update).start()
        if sent.is_set() and len(groups) >= 4 and group[0].weight_versions == (5,):
            feed.close()

    child.stream(feed, PARAMS, on_group, max_inflight=2)
    versions = {r.weight_versions for g in groups for r in g}
    assert (0,) in versions and (5,) in versions
    assert (0, 5) in versions  # rows in flight at the swap went on under the new weights
    # Responses sampled wholly under version 5 are what the new weights sample.
    local.update_weights(list(new_state.items()))
    local.finish_weight_update(version=5)
    for group in groups:
        if group[0].weight_versions == (5,):
            index = group[0].prompt_index
            want = local.generate([PROMPTS[index % len(PROMPTS)]], PARAMS, index_offset=index)
            assert _key(group) == _key(want)
    # Put the fixture's child back to the checkpoint's weights for the other tests.
    child.update_weights(list(LocalEngine(tiny, name="orig").model.state_dict().items()))
    child.finish_weight_update(version=0)


def test_a_failing_callback_stops_the_child_and_raises_here(child):
    feed = PromptFeed(iter(PROMPTS))

    def on_group(group):
        raise RuntimeError("reward pool died")

    with pytest.raises(RuntimeError, match="reward pool died"):
        child.stream(feed, PARAMS, on_group, max_inflight=2)
    assert len(child.generate([[1, 2]], PARAMS)) == 2  # still serving


def test_a_dead_child_is_an_engine_error_naming_its_exit(tiny):
    engine = ProcessEngine(tiny, name="doomed", num_threads=1)
    os.kill(engine._process.pid, signal.SIGKILL)
    with pytest.raises(EngineError, match=r"engine doomed: its process \(pid \d+\) exited with code -9"):
        engine.generate([[1, 2]], PARAMS)
    assert engine.health() is False
    engine.shutdown()


def test_a_send_that_finds_the_pipe_broken_names_the_exit_too(tiny, monkeypatch):
    """The race CI can lose: the caller's send hits the broken pipe before the reader thread has
    recorded the exit. Here the reader records nothing, so only the send can name it."""
    engine = ProcessEngine(tiny, name="doomed", num_threads=1)
    saw_eof = threading.Event()
    monkeypatch.setattr(engine, "_fail_all", lambda why: saw_eof.set())
    os.kill(engine._process.pid, signal.SIGKILL)
    assert saw_eof.wait(30), "the reader never saw the pipe close"
    with pytest.raises(EngineError, match=r"^engine doomed: its process \(pid \d+\) exited with code -9$"):
        engine.abort()  # a send, and nothing else
    engine.shutdown()


def test_a_bad_checkpoint_fails_the_start_with_the_reason(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineError, match=r"engine bad: loading .* failed"):
        ProcessEngine(tmp_path, name="bad", num_threads=1, start_timeout_s=120)


def test_the_launchers_signals_are_left_to_the_trainer(tiny):
    # SLURM's USR1 and preemption's TERM reach every process of the job; the trainer saves on
    # them and still needs its engine for nothing but a clean stop, so the child must not die.
    engine = ProcessEngine(tiny, name="sig", num_threads=1)
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        os.kill(engine._process.pid, sig)
    assert engine.health() is True
    engine.shutdown()
    assert engine._process.exitcode == 0
