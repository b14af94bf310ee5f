"""Streaming generation: prompts go to the engines as they have room, groups come back as they finish.

The round-based loop (generate a round of prompts, score, filter, repeat) waits for the
slowest response of every round and generates whole rounds the batch may not need.
Streaming (slime's over-sampling with abort) instead keeps the engines busy with a window of
prompts: each engine takes the next prompt from a shared `PromptFeed` whenever it has room,
hands a prompt's group of n responses to the collector as soon as all n are done, and stops
when the collector closes the feed and aborts it because the batch is full.

Engines that batch on their own (the local engine's continuous batching) implement
`stream` natively. For servers (SGLang, vLLM), `stream_per_prompt` keeps `max_inflight`
prompts in flight with one request per prompt; the server's continuous batching does the rest.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from megatron_dapo.rollout.engine import EngineError, GenerationResult, RolloutEngine, SamplingParams

__all__ = ["CarriedPrompt", "FeedItem", "GroupCallback", "ItemDriver", "PromptFeed", "StreamingEngine", "TrackedFeed", "Turns",
           "continuation", "stream_per_prompt"]

GroupCallback = Callable[[list[GenerationResult]], None]
"""Receives one prompt's n finished responses (sample order); may close the feed and abort."""
Turns = Callable[[Sequence[Sequence[int]], SamplingParams], list[GenerationResult]]
"""One engine's generate for one feed item's requests: results indexed from 0, seeded at the item's index."""
ItemDriver = Callable[[Turns, "FeedItem", SamplingParams, Callable[[], bool]], list[GenerationResult]]
"""Drives one feed item to its n results over several requests (multi-turn episodes: tools/episode.py):
(turns, item, params, aborted) -> results in sample order, prompt_index = item.index."""


@dataclass(frozen=True, slots=True)
class CarriedPrompt:
    """A prompt whose group a full batch cut short, to continue (a PromptFeed input)."""

    prompt: Sequence[int]
    """Prompt token ids."""
    results: tuple[GenerationResult, ...]
    """Its n responses so far (sample order); reason abort = continue from its tokens."""


@dataclass(frozen=True, slots=True)
class FeedItem:
    """One prompt handed to an engine."""

    index: int
    """Global prompt index within the step (seeds and results use it)."""
    prompt: Sequence[int]
    """Prompt token ids."""
    carried: tuple[GenerationResult, ...] | None = None
    """A partial rollout's group from an earlier step (n results, sample order): results with
    reason abort are continued from their tokens, the others are final as they are."""


def continuation(carried: GenerationResult, more: GenerationResult) -> GenerationResult:
    """A carried partial response followed by what was generated after it; its versions are both
    parts' (oldest first: dropping the continuation's once left a response cut with no tokens,
    as vLLM 0.32 answers an abort, with no version at all, and the staleness bound unchecked)."""
    return GenerationResult(prompt_index=more.prompt_index, sample_index=carried.sample_index,
                            output_ids=[*carried.output_ids, *more.output_ids],
                            logprobs=[*carried.logprobs, *more.logprobs], finish_reason=more.finish_reason,
                            weight_versions=tuple(dict.fromkeys((*carried.weight_versions, *more.weight_versions))),
                            routed_experts=more.routed_experts)  # its prompt held the carried tokens


def settled(carried: GenerationResult, params: SamplingParams) -> GenerationResult:
    """A carried response as it is to be continued: one cut with all of its max_new_tokens is done,
    by "length" (an abort that reaches a server together with a row's last token is answered
    "abort" with every token: SGLang 0.5.18 on the CPU fleet, CI 2026-11-28; continuing it asked
    for 0 new tokens). Its routes stay what the cut row had (SGLang reports none for an abort)."""
    if carried.finish_reason == "abort" and len(carried.output_ids) >= params.max_new_tokens:
        return replace(carried, finish_reason="length")
    return carried


class PromptFeed:
    """Prompts handed out one at a time to whichever engine has room; thread-safe.

    A prompt counts as taken (consumed from the dataset) when an engine takes it, so the
    collector can tell how many prompts a step used, and prompts never taken stay unread.
    An optional `gate` lets the collector hold prompts back while the ones in flight are
    expected to fill the batch; it is asked under the feed's lock, and the collector calls
    `notify` whenever its answer may have changed.
    """

    def __init__(
        self, prompts: Iterator[Sequence[int] | CarriedPrompt], *,
        limit: int | None = None, gate: Callable[[int], bool] | None = None,
    ) -> None:
        """Args:
            prompts: the prompts' token ids, drawn lazily (e.g. from the PromptSampler), or
                CarriedPrompts for partial rollouts to continue.
            limit: the most prompts to hand out (None = as many as `prompts` yields).
            gate: called with the number taken so far; False = not now (the feed is not exhausted).
        """
        self._prompts = prompts
        self._limit = limit
        self._gate = gate
        self._changed = threading.Condition()
        self._closed = False
        self._again: list[FeedItem] = []
        self.num_taken = 0

    def take(self, *, block: bool = True, stop: Callable[[], bool] | None = None) -> FeedItem | None:
        """The next prompt.

        Args:
            block: wait while the gate holds prompts back; False returns None at once then
                (check `exhausted` to tell "not now" from "no more").
            stop: one taker's own end (a view that was closed, see the controller's
                TrackedFeed): None at once when it is true; waiters are woken by notify().

        Returns:
            The prompt, or None once closed or exhausted (or held back, without block).
        """
        with self._changed:
            while (not self._again and not self._exhausted() and self._gate is not None
                   and not self._gate(self.num_taken)):
                if not block or (stop is not None and stop()):
                    return None
                self._changed.wait()
            if self._exhausted() or (stop is not None and stop()):
                return None
            if self._again:
                return self._again.pop(0)
            prompt = next(self._prompts, None)
            if prompt is None:
                self._closed = True
                self._changed.notify_all()
                return None
            index = self.num_taken
            self.num_taken += 1
            if isinstance(prompt, CarriedPrompt):
                return FeedItem(index=index, prompt=prompt.prompt, carried=prompt.results)
            return FeedItem(index=index, prompt=prompt)

    def requeue(self, items: Sequence[FeedItem]) -> None:
        """Hand these out again, first (a restarted engine's lost prompts).

        They keep their indices (so their seeds, hence a seeded engine's tokens) and are not
        counted again in num_taken; the gate and the limit do not hold them back.
        """
        with self._changed:
            self._again[:0] = sorted(items, key=lambda item: item.index)
            self._changed.notify_all()

    def notify(self) -> None:
        """Wake blocked takers: the gate's answer may have changed."""
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        """Hand out nothing more."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @property
    def exhausted(self) -> bool:
        """Whether take() can return nothing more."""
        with self._changed:
            return self._exhausted()

    def _exhausted(self) -> bool:
        if self._closed:
            return True
        return not self._again and self._limit is not None and self.num_taken >= self._limit


@runtime_checkable
class StreamingEngine(Protocol):
    """An engine with its own streaming loop (the local engine)."""

    def stream(
        self, feed: PromptFeed, params: SamplingParams, on_group: GroupCallback, *, max_inflight: int
    ) -> list[GenerationResult]:
        """Generate for prompts taken from `feed` until it is exhausted or abort() comes.

        At most `max_inflight` prompts are in flight at once.

        Returns:
            The responses cut short by abort(), with whatever tokens they had.
        """
        ...


def stream_per_prompt(
    engine: RolloutEngine, feed: PromptFeed, params: SamplingParams, on_group: GroupCallback, *, max_inflight: int,
    generate_item: Callable[[RolloutEngine, FeedItem, SamplingParams], list[GenerationResult]] | None = None,
    abort_asked: Callable[[], bool] | None = None,
) -> list[GenerationResult]:
    """Stream through an engine's generate(): one request per prompt, `max_inflight` at a time.

    `generate_item` replaces the one request per prompt (multi-turn episodes: the controller's
    drive), called from `max_inflight` threads at once.

    A prompt whose responses come back with an abort is not a group (its results are
    returned instead); every worker then takes the next prompt until the feed is exhausted.
    An abort nobody asked for (`abort_asked` false, the feed still open) is the server's own: a
    server stopping answers its requests "abort" (vLLM's shutdown). Kept as a cut prompt, it
    would count as in flight until the session ends and shut the collector's gate for good
    (seen: a vLLM fleet whose survivor was stopped after a failed broadcast waited forever); it
    is an EngineError instead, so the controller hands the prompt out again and restarts the engine.

    Raises:
        The first error of any request, after the others finished or were aborted by it.
    """
    aborted: list[GenerationResult] = []
    lock = threading.Lock()
    generate_item = generate_item or _generate_item

    def worker() -> None:
        while (item := feed.take()) is not None:
            results = generate_item(engine, item, params)
            if any(r.finish_reason == "abort" for r in results):
                if abort_asked is not None and not abort_asked() and not feed.exhausted:
                    raise EngineError(f"engine {engine.name} answered prompt {item.index} with an abort nobody "
                                      "asked for (its server is stopping)")
                with lock:
                    aborted.extend(results)
            else:
                on_group(results)

    with ThreadPoolExecutor(max_workers=max(1, max_inflight), thread_name_prefix=f"{engine.name}-stream") as pool:
        futures = [pool.submit(worker) for _ in range(max(1, max_inflight))]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f in done and f.exception() is not None), None)
        if failed is not None:
            feed.close()
            if not isinstance(failed.exception(), EngineError):  # e.g. the collector's reward failed: stop generating
                with contextlib.suppress(Exception):  # the first error is the one to report
                    engine.abort()
            # An engine that failed is not aborted: a hung server would hold every abort for its
            # control timeout; its other requests fail on their own health checks.
            wait(futures)
            raise failed.exception()  # type: ignore[misc]
    return aborted


def _generate_item(engine: RolloutEngine, item: FeedItem, params: SamplingParams) -> list[GenerationResult]:
    """The n responses of one feed item: all new, or a carried group's unfinished ones continued."""
    if item.carried is None:
        return engine.generate([item.prompt], params, index_offset=item.index)
    results = []
    for carried in item.carried:
        carried = settled(carried, params)
        if carried.finish_reason != "abort":
            results.append(replace(carried, prompt_index=item.index))
            continue
        # One request per continued response, its context the prompt and the tokens so far;
        # seeded by its own response index (the step's seed, index * n + sample).
        more = engine.generate([[*item.prompt, *carried.output_ids]],
                               replace(params, n=1, max_new_tokens=params.max_new_tokens - len(carried.output_ids)),
                               index_offset=item.index * params.n + carried.sample_index)[0]
        results.append(replace(continuation(carried, more), prompt_index=item.index))
    return results


class TrackedFeed:
    """One engine's view of the shared PromptFeed that remembers what it took and has not finished.

    Closing it ends this view only (its takers get None, blocked ones are woken): when the
    engine fails, its streaming loop closes what it was given, and the shared feed must stay
    open for the other engines and for the restarted engine's new view (stream_per_prompt
    closes its feed on any error; a closed shared feed ended the step with no group).
    """

    def __init__(self, feed: PromptFeed) -> None:
        self._feed = feed
        self._lock = threading.Lock()
        self._taken: dict[int, FeedItem] = {}
        self._closed = threading.Event()

    def take(self, *, block: bool = True) -> FeedItem | None:
        item = self._feed.take(block=block, stop=self._closed.is_set)
        if item is not None:
            with self._lock:
                self._taken[item.index] = item
        return item

    def finished(self, index: int) -> None:
        with self._lock:
            self._taken.pop(index, None)

    def in_flight(self) -> list[FeedItem]:
        with self._lock:
            return list(self._taken.values())

    def close(self) -> None:
        self._closed.set()
        self._feed.notify()

    def notify(self) -> None:
        self._feed.notify()

    @property
    def exhausted(self) -> bool:
        return self._closed.is_set() or self._feed.exhausted

    @property
    def num_taken(self) -> int:
        return self._feed.num_taken
