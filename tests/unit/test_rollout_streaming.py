"""Streaming generation: continuous batching in the local engine, the prompt feed, per-prompt streaming."""

import threading
import time

import pytest
import torch
from test_rollout_local_engine import EOS, PROMPTS, make_tiny_qwen2

from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import EngineError, GenerationResult, SamplingParams
from megatron_dapo.rollout.local.engine import LocalEngine
from megatron_dapo.rollout.streaming import (
    CarriedPrompt,
    FeedItem,
    PromptFeed,
    StreamingEngine,
    stream_per_prompt,
)

# Stopping on a few frequent tokens ends responses at different steps, so rows leave and join.
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=11, stop_token_ids=(10, 20, 30, 40, 50, EOS))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    return path, make_tiny_qwen2(path)


class GenerateOnly:
    """An engine with generate() and abort() only, as the server engines are to the streaming code."""

    def __init__(self, engine: LocalEngine) -> None:
        self.name, self._engine = "generate-only", engine

    def generate(self, prompts, params, *, index_offset=0):
        return self._engine.generate(prompts, params, index_offset=index_offset)

    def abort(self):
        self._engine.abort()

    def clear_abort(self):
        self._engine.clear_abort()

    def shutdown(self):
        self._engine.shutdown()



class Restartable(GenerateOnly):
    """A server engine the controller may restart in place; its calls (-1 = a restart) are recorded."""

    log_path = None
    restartable = True

    def __init__(self, engine: LocalEngine, calls: list[int]) -> None:
        super().__init__(engine)
        self.calls = calls

    def restart(self):
        self.calls.append(-1)

def test_rows_joining_a_running_batch_compute_what_they_compute_alone(tiny):
    path, _ = tiny
    engine = LocalEngine(path, max_batch_size=3)  # 8 rows through 3 slots: rows must join mid-flight
    shapes: list[tuple[int, int]] = []
    engine.model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)
    joined = engine.generate(PROMPTS, PARAMS)
    assert max(rows for rows, _ in shapes) <= 3
    # A prefill (more than one position) after the first forward: newcomers joined a running batch.
    assert any(length > 1 for _, length in shapes[1:])
    lengths = {len(r.output_ids) for r in joined}
    assert len(lengths) > 1
    for i, prompt in enumerate(PROMPTS):
        alone = LocalEngine(path).generate([prompt], PARAMS, index_offset=i)
        mine = joined[2 * i : 2 * i + 2]
        assert [(r.output_ids, r.finish_reason) for r in alone] == [(r.output_ids, r.finish_reason) for r in mine]
        for a, b in zip(alone, mine):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_stream_hands_back_each_group_once_with_the_tokens_generate_gives(tiny):
    path, _ = tiny
    expected = LocalEngine(path).generate(PROMPTS, PARAMS)
    engine = LocalEngine(path, max_batch_size=4)
    assert isinstance(engine, StreamingEngine)
    groups = []
    feed = PromptFeed(iter(PROMPTS))
    aborted = engine.stream(feed, PARAMS, groups.append, max_inflight=8)
    assert aborted == [] and feed.num_taken == 4 and feed.exhausted
    assert sorted(g[0].prompt_index for g in groups) == [0, 1, 2, 3]
    for group in groups:
        assert [r.sample_index for r in group] == [0, 1]
        i = group[0].prompt_index
        assert [r.output_ids for r in group] == [r.output_ids for r in expected[2 * i : 2 * i + 2]]


def test_a_callback_that_aborts_stops_the_stream_at_the_same_point_every_run(tiny):
    path, _ = tiny
    many = [PROMPTS[i % 4] for i in range(12)]

    def run_once():
        engine = LocalEngine(path, max_batch_size=6)
        feed = PromptFeed(iter(many))
        groups = []

        def on_group(group):
            groups.append(group)
            if len(groups) == 3:  # the collector's "batch full"
                feed.close()
                engine.abort()

        aborted = engine.stream(feed, PARAMS, on_group, max_inflight=3)
        return groups, aborted, feed.num_taken

    groups, aborted, taken = run_once()
    assert len(groups) == 3 and 3 <= taken < 12
    incomplete = {r.prompt_index for r in aborted}
    # Every incomplete prompt had a response cut short; its mates may have finished before.
    assert incomplete == {r.prompt_index for r in aborted if r.finish_reason == "abort"}
    assert {r.prompt_index for r in aborted}.isdisjoint({g[0].prompt_index for g in groups})
    assert len(aborted) + 2 * len(groups) == 2 * taken  # every taken prompt ends as a group or aborted
    again = run_once()
    assert [[r.output_ids for r in g] for g in groups] == [[r.output_ids for r in g] for g in again[0]]
    assert (taken, [r.output_ids for r in aborted]) == (again[2], [r.output_ids for r in again[1]])


def test_max_inflight_bounds_the_rows_of_the_local_engine(tiny):
    path, _ = tiny
    engine = LocalEngine(path)
    rows: list[int] = []
    engine.model.register_forward_hook(lambda m, args, out: rows.append(out.logits.shape[0]))
    engine.stream(PromptFeed(iter(PROMPTS * 3)), PARAMS, lambda g: None, max_inflight=2)
    assert max(rows) <= 4  # 2 prompts x n=2


def test_feed_limit_gate_and_close():
    feed = PromptFeed(iter([[1], [2], [3], [4]]), limit=3)
    assert feed.take() == FeedItem(index=0, prompt=[1])
    open_gate = threading.Event()
    gated = PromptFeed(iter([[1], [2]]), gate=lambda taken: taken == 0 or open_gate.is_set())
    assert gated.take(block=False) == FeedItem(index=0, prompt=[1])
    assert gated.take(block=False) is None and not gated.exhausted  # held back, not finished
    got = []
    waiter = threading.Thread(target=lambda: got.append(gated.take()))
    waiter.start()
    time.sleep(0.05)
    assert got == []  # blocked on the gate
    open_gate.set()
    gated.notify()
    waiter.join(5)
    assert got == [FeedItem(index=1, prompt=[2])]
    assert [feed.take().index, feed.take().index] == [1, 2]
    assert feed.take() is None and feed.exhausted  # the limit
    closing = PromptFeed(iter([[1]]), gate=lambda taken: False)
    waiter = threading.Thread(target=lambda: got.append(closing.take()))
    waiter.start()
    closing.close()
    waiter.join(5)
    assert got[-1] is None and not waiter.is_alive()


def test_per_prompt_streaming_gives_the_native_groups(tiny):
    path, _ = tiny
    native: list = []
    LocalEngine(path).stream(PromptFeed(iter(PROMPTS)), PARAMS, native.append, max_inflight=4)
    lock = threading.Lock()
    served: list = []

    def collect(group):
        with lock:
            served.append(group)

    aborted = stream_per_prompt(GenerateOnly(LocalEngine(path)), PromptFeed(iter(PROMPTS)), PARAMS, collect,
                                max_inflight=2)
    assert aborted == []
    by_prompt = {g[0].prompt_index: [r.output_ids for r in g] for g in native}
    assert {g[0].prompt_index: [r.output_ids for r in g] for g in served} == by_prompt


def test_controller_stream_aborts_the_others_and_raises_the_first_engine_error(tiny):
    path, _ = tiny

    class Dies(GenerateOnly):
        def generate(self, prompts, params, *, index_offset=0):
            raise EngineError("engine dies: connection refused")

    healthy = LocalEngine(path, name="healthy")
    aborts = []
    original_abort = healthy.abort
    healthy.abort = lambda: (aborts.append(1), original_abort())
    controller = RolloutController([healthy, Dies(LocalEngine(path))])
    feed = PromptFeed(iter(PROMPTS * 50))
    with pytest.raises(EngineError, match="connection refused"):
        controller.stream(feed, PARAMS, lambda group: None, max_inflight=2)
    assert feed.exhausted and aborts  # nothing more handed out, the healthy engine was stopped
    controller.shutdown()


def test_a_server_engine_restarted_mid_stream_keeps_the_shared_feed_open(tiny):
    """A per-prompt (server) engine that dies mid-stream is restarted and takes up the feed again.

    stream_per_prompt closes the feed it was given when a request fails; that must end only
    the dead engine's view. Found by killing vLLM's server in a training run: the shared feed
    was closed, and the step ended with none of its 16 groups."""
    path, _ = tiny
    calls: list[int] = []

    class DiesOnce(Restartable):
        def generate(self, prompts, params, *, index_offset=0):
            self.calls.append(index_offset)
            if len(self.calls) == 3:
                raise EngineError("engine server0 exited with code -9")
            return super().generate(prompts, params, index_offset=index_offset)

    controller = RolloutController([DiesOnce(LocalEngine(path), calls)], max_restarts=1)
    groups: list = []
    try:
        controller.stream(PromptFeed(iter(PROMPTS)), PARAMS, groups.append, max_inflight=2)
    finally:
        controller.shutdown()
    assert controller.num_restarts == 1 and -1 in calls
    assert sorted(g[0].prompt_index for g in groups) == list(range(len(PROMPTS)))  # each prompt once


def test_per_prompt_streaming_continues_a_carried_group_from_its_tokens(tiny):
    path, _ = tiny
    first = LocalEngine(path).generate([PROMPTS[2]], PARAMS)
    cut = GenerationResult(prompt_index=0, sample_index=1, output_ids=first[1].output_ids[:1],
                           logprobs=first[1].logprobs[:1], finish_reason="abort")
    carried = CarriedPrompt(prompt=PROMPTS[2], results=(first[0], cut))
    groups: list = []
    aborted = stream_per_prompt(GenerateOnly(LocalEngine(path)), PromptFeed(iter([carried])), PARAMS,
                                groups.append, max_inflight=1)
    assert aborted == [] and len(groups) == 1
    done, resumed = groups[0]
    assert (done.output_ids, done.logprobs, done.finish_reason) == (first[0].output_ids, first[0].logprobs,
                                                                   first[0].finish_reason)
    # The cut response keeps its token and the log-prob it was sampled with, then goes on.
    assert resumed.output_ids[:1] == cut.output_ids and resumed.logprobs[:1] == cut.logprobs
    assert resumed.finish_reason != "abort" and len(resumed.output_ids) <= PARAMS.max_new_tokens


@pytest.mark.parametrize("engine_kind", ["server", "local"])
def test_a_carried_response_cut_with_all_its_tokens_is_done_not_continued(tiny, engine_kind):
    """CI 2026-11-28: SGLang answered an abort that met a row's last token "abort" with all
    max_new_tokens tokens; continuing it asked for 0 more (SamplingParams refuses) and ended the run.
    Such a response is finished by "length", on the server engines' path and the local engine's."""
    path, _ = tiny
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=3)
    first = LocalEngine(path).generate([PROMPTS[1]], params)
    assert all(len(r.output_ids) == 4 for r in first)  # no stop tokens: both run to the cap
    full_cut = GenerationResult(prompt_index=0, sample_index=0, output_ids=first[0].output_ids,
                                logprobs=first[0].logprobs, finish_reason="abort")
    part_cut = GenerationResult(prompt_index=0, sample_index=1, output_ids=first[1].output_ids[:2],
                                logprobs=first[1].logprobs[:2], finish_reason="abort")
    carried = CarriedPrompt(prompt=PROMPTS[1], results=(full_cut, part_cut))
    engine = LocalEngine(path)
    sent: list[int] = []
    if engine_kind == "server":
        class Counting(GenerateOnly):
            def generate(self, prompts, p, *, index_offset=0):
                sent.append(p.max_new_tokens)
                return super().generate(prompts, p, index_offset=index_offset)

        engine = Counting(engine)
    groups: list = []
    aborted = stream_per_prompt(engine, PromptFeed(iter([carried])), params, groups.append, max_inflight=1)
    assert aborted == [] and len(groups) == 1
    done, resumed = groups[0]
    assert (done.output_ids, done.finish_reason) == (first[0].output_ids, "length")
    assert resumed.output_ids[:2] == part_cut.output_ids and resumed.finish_reason == "length"
    assert len(resumed.output_ids) == 4
    if engine_kind == "server":
        assert sent == [2]  # only the part-cut response was sent again, for its 2 missing tokens


def test_an_abort_nobody_asked_for_is_an_engine_failure_not_a_prompt_lost_to_the_gate(tiny):
    """A vLLM fleet hung (2026-11-28): after a failed broadcast the controller stopped every server,
    and a server that is stopping answers its requests "abort". Kept as cut prompts, those counted as
    in flight for the rest of the session, so the collector's gate stayed shut with nothing running.
    Now such an answer is the engine's failure: the prompt is handed out again and the engine restarted."""
    path, _ = tiny
    calls: list[int] = []

    class Stopping(Restartable):
        def generate(self, prompts, params, *, index_offset=0):
            self.calls.append(index_offset)
            if len(self.calls) == 2:  # a stopping server: every row cut, no tokens
                return [GenerationResult(prompt_index=index_offset, sample_index=j, output_ids=[], logprobs=[],
                                         finish_reason="abort") for j in range(params.n)]
            return super().generate(prompts, params, index_offset=index_offset)

    controller = RolloutController([Stopping(LocalEngine(path), calls)], max_restarts=1)
    groups: list = []
    # The collector's gate: a prompt is taken only while nothing else is in flight.
    feed = PromptFeed(iter(PROMPTS), gate=lambda taken: taken - len(groups) < 1)
    results: list = []
    thread = threading.Thread(target=lambda: results.append(
        controller.stream(feed, PARAMS, lambda g: (groups.append(g), feed.notify()), max_inflight=1)), daemon=True)
    try:
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive(), "the stream waited on its gate with nothing in flight"
    finally:
        feed.close()
        controller.shutdown()
    assert results == [[]] and controller.num_restarts == 1 and -1 in calls
    assert sorted(g[0].prompt_index for g in groups) == list(range(len(PROMPTS)))  # each prompt once


def test_an_abort_that_was_asked_for_stays_a_cut_prompt(tiny):
    """The collector's own abort (the feed still open, as the asynchronous loop's stop sends it) is
    not an engine failure: the cut rows come back for the carry, no restart; and nothing more is
    taken from the feed after it."""
    path, _ = tiny

    class Cut(GenerateOnly):
        name = "server0"
        log_path = None
        restartable = True

        def generate(self, prompts, params, *, index_offset=0):
            controller.abort()
            return [GenerationResult(prompt_index=index_offset, sample_index=j, output_ids=[], logprobs=[],
                                     finish_reason="abort") for j in range(params.n)]

        def restart(self):
            raise AssertionError("an asked-for abort restarted the engine")

    controller = RolloutController([Cut(LocalEngine(path))], max_restarts=1)
    feed = PromptFeed(iter(PROMPTS[:2]))
    try:
        cut = controller.stream(feed, PARAMS, lambda g: None, max_inflight=1)
    finally:
        controller.shutdown()
    assert controller.num_restarts == 0 and len(cut) == PARAMS.n and feed.num_taken == 1
