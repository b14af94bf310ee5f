"""Where an episode is driven: turns of generation with tool calls in between, token ids only.

One call of :meth:`EpisodeRunner.generate` stands for one call of an engine's ``generate``
(``params.n`` responses per prompt, prompt-major), so collection code calls either the same way.
Each response is an episode:

1. The engine generates with the format's call-close token as an extra stop token.
2. A turn that stopped on it holds a call: the turn's text (decoded for reading only) is
   parsed (tools/formats.py), the tool runs (tools in flight at once: ``calls_in_flight``), and
   its answer is tokenized, cut in the middle to ``max_tool_output_tokens`` and appended as
   tool tokens. The answer is a tool's (a user's) text, so it is first cut in characters
   (``_CHARS_PER_TOKEN`` per token of the cap, head and tail: a 200 MB answer is never tokenized
   whole) and its lone surrogates replaced with U+FFFD (a tokenizer cannot encode them).
3. Generation continues from the concatenated ids (prompt + every segment so far, never
   re-tokenized), with the episode's remaining budget, until a turn ends without a call, the
   budget (``max_response_tokens``, policy and tool tokens together: data.max_response_length)
   is spent (reason "length") or ``max_turns`` policy turns ran (reason "length", turn_capped).

The result's ``output_ids`` are every segment in order; ``logprobs`` the engine's for policy
tokens and 0.0 for tool tokens; ``episode.policy_mask`` tells them apart. A tool that fails,
times out or is not known answers with an error text: the trainer never sees an exception.
Routes (R3) are the last turn's, which cover the whole sequence but its last token.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_dapo.data.tokenizer import Tokenizer
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.engine import EpisodeRecord, GenerationResult, SamplingParams, ToolCallRecord
from megatron_dapo.tools.formats import CallFormat, ParsedCall, pad_result
from megatron_dapo.tools.sandbox import ToolResult

__all__ = ["EpisodeRunner", "EpisodeSettings", "Generate", "Tool", "ToolPoolBroken", "check_call_close", "episode_metrics",
           "episode_row", "episode_rows_metrics"]

Generate = Callable[[Sequence[Sequence[int]], SamplingParams], list[GenerationResult]]
"""An engine's (or the controller's) generate: prompts, params -> prompt-major results."""
Tool = Callable[[str], ToolResult]
"""A tool: its argument -> what it answered."""
_ABORT_POLL_S = 0.05
"""How often a wait for tool answers looks at the collector's abort."""
_CHARS_PER_TOKEN = 32
"""Characters of an answer kept per token of max_tool_output_tokens, at each end, before it is
tokenized: more than any token of a text tokenizer spans, so the cut in tokens still decides."""
_CUT = " ... "
"""What stands for the cut middle of a long answer."""
_SURROGATE = re.compile("[\ud800-\udfff]")
"""A code point no encoding can write (a lone surrogate, e.g. from a tool's os.fsdecode)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EpisodeSettings:
    """The tools section, resolved."""

    fmt: CallFormat
    tools: Mapping[str, Tool]
    max_turns: int = 4
    """Policy turns per episode (so at most max_turns - 1 tool calls are answered)."""
    max_tool_output_tokens: int = 64
    """Tokens of one answer (markers included); longer answers are cut in the middle."""
    result_width: int = 0
    """Answers are right-padded to this many characters (formats.pad_result); 0 = as written."""
    max_response_tokens: int = 512
    """The whole episode's budget after the prompt (data.max_response_length)."""
    calls_in_flight: int = 8
    """Tool calls run at once."""
    max_failure_fraction: float = 1.0
    """A generate call whose calls failed to run (status failed) more than this share, from 16
    calls on, stops the run (ToolPoolBroken)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tool_output_tokens < 4 or self.calls_in_flight < 1:
            raise ValueError("tools: max_turns >= 1, max_tool_output_tokens >= 4 and calls_in_flight >= 1")


@dataclass
class _Episode:
    """One episode's state while it runs: everything is in its tokens (so an aborted one resumes
    from its GenerationResult alone, see resume) plus ``next``, what it waits for."""

    prompt: list[int]
    prompt_index: int
    sample_index: int
    close_id: int
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    calls: list[ToolCallRecord] = field(default_factory=list)
    turns: int = 0
    finish: str = "stop"
    versions: tuple[int, ...] = ()
    routes: np.ndarray | None = None
    capped: bool = False
    next: str | None = "turn"
    """turn: a new policy turn; continue: the last turn was cut short and goes on; call: the last
    turn asked for a call; None: finished (``finish`` says how)."""

    @classmethod
    def resume(cls, prompt: list[int], r: GenerationResult, close_id: int, budget: int) -> _Episode:
        """The episode an earlier call returned; one with reason abort goes on where it stopped,
        unless the abort came after its last token of ``budget`` (it is done: reason length, as
        streaming.settled does for a plain response; going on would ask for 0 tokens)."""
        record = r.episode
        mask = list(record.policy_mask) if record is not None else [1] * len(r.output_ids)
        e = cls(prompt, r.prompt_index, r.sample_index, close_id, out=list(r.output_ids), logprobs=list(r.logprobs),
                mask=mask, calls=list(record.calls) if record is not None else [],
                turns=record.turns if record is not None else int(bool(r.output_ids)),
                finish=r.finish_reason, versions=r.weight_versions, routes=r.routed_experts,
                capped=record.turn_capped if record is not None else False, next=None)
        if r.finish_reason == "abort" and len(e.out) >= budget:
            e.finish = "length"
        elif r.finish_reason == "abort":
            if not e.out:
                e.next = "turn"
            elif not e.mask[-1]:
                e.next = "turn"  # the answer is in: the next turn had not started
            elif e.out[-1] == close_id:
                e.next = "call"  # the call's answer never came: it runs again
            else:
                e.next = "continue"
        return e

    @property
    def last_turn(self) -> list[int]:
        """The policy tokens after the last tool answer (the last turn, all of it when resumed)."""
        start = len(self.mask)
        while start and self.mask[start - 1]:
            start -= 1
        return self.out[start:]

    def add_turn(self, r: GenerationResult, room: int, budget: int) -> None:
        """Append a turn's tokens (at most ``room``); ``next`` says whether it asked for a call."""
        ids, lps = r.output_ids[:room], r.logprobs[:room]
        if self.next != "continue" and ids:  # a turn the abort stopped before its first token is not one
            self.turns += 1
        self.out += ids
        self.logprobs += lps
        self.mask += [1] * len(ids)
        self.finish = "length" if len(r.output_ids) > room else r.finish_reason
        self.versions = tuple(dict.fromkeys((*self.versions, *r.weight_versions)))
        self.routes = r.routed_experts
        asks = self.finish == "stop" and bool(ids) and ids[-1] == self.close_id and len(self.out) < budget
        self.next = "call" if asks else None

    def add_answer(self, record: ToolCallRecord, ids: list[int], budget: int) -> None:
        """Append a call's answer as tool tokens; a turn follows unless the budget is spent."""
        room = budget - len(self.out)
        self.calls.append(record)
        self.out += ids[:room]
        self.logprobs += [0.0] * len(ids[:room])
        self.mask += [0] * len(ids[:room])
        self.finish, self.next = ("length", None) if len(ids) >= room else ("stop", "turn")

    def stop(self, finish: str, *, capped: bool = False) -> None:
        self.finish, self.next, self.capped = finish, None, self.capped or capped

    def result(self) -> GenerationResult:
        # The last turn's routes cover the prompt and every segment before its last token; an
        # episode that ended on a tool answer has none for those trailing tool positions, which
        # predict no policy token (causal attention): routing replay leaves them free.
        rows = len(self.prompt) + len(self.out) - 1
        routes = self.routes if self.routes is not None and len(self.routes) <= rows else None
        return GenerationResult(
            prompt_index=self.prompt_index, sample_index=self.sample_index, output_ids=self.out,
            logprobs=self.logprobs, finish_reason=self.finish, weight_versions=self.versions, routed_experts=routes,
            episode=EpisodeRecord(policy_mask=tuple(self.mask), turns=self.turns, calls=tuple(self.calls),
                                  turn_capped=self.capped))


def episode_row(r: GenerationResult, tokenizer: Tokenizer) -> dict[str, Any]:
    """An episode's turns for a JSONL row (`megatron-dapo eval`): segments [{"by": "policy"|"tool", "text"}], calls, counts."""
    segments: list[dict[str, str]] = []
    mask, ids = r.episode.policy_mask, r.output_ids
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            segments.append({"by": "policy" if mask[start] else "tool", "text": tokenizer.decode(ids[start:end])})
            start = end
    return {"turns": r.episode.turns, "turn_capped": r.episode.turn_capped, "tool_tokens": r.episode.tool_tokens,
            "segments": segments, "calls": [dataclasses.asdict(c) for c in r.episode.calls]}


def episode_rows_metrics(episodes: Sequence[dict[str, Any]]) -> dict[str, float]:
    """tools/* of `megatron-dapo eval`'s summary, from its rows' episodes (episode_row); {} without any."""
    stats = _tool_stats([(e["turns"], [c["status"] for c in e["calls"]], sum(c["seconds"] for c in e["calls"]),
                          bool(e["turn_capped"]), e["tool_tokens"]) for e in episodes])
    return {k: v for k, v in stats.items() if k not in ("tools/call_rate", "tools/error_rate")}


def _tool_stats(episodes: Sequence[tuple[int, list[str], float, bool, int]]) -> dict[str, float]:
    """tools/* of (turns, call statuses, tool seconds, turn capped, tool tokens) per episode; {} without any."""
    if not episodes:
        return {}
    n = len(episodes)
    calls = sum(len(statuses) for _, statuses, *_ in episodes)
    errors = sum(s != "ok" for _, statuses, *_ in episodes for s in statuses)
    return {
        "tools/turns_mean": sum(e[0] for e in episodes) / n,
        "tools/turns_max": float(max(e[0] for e in episodes)),
        "tools/calls_per_episode": calls / n,
        "tools/call_rate": sum(bool(e[1]) for e in episodes) / n,
        "tools/errors_per_episode": errors / n,
        "tools/error_rate": errors / calls if calls else 0.0,
        "tools/seconds": sum(e[2] for e in episodes),
        "tools/turn_capped": sum(e[3] for e in episodes) / n,
        "tools/tokens_per_episode": sum(e[4] for e in episodes) / n,
    }


class ToolPoolBroken(UserError):
    """Too many tool calls failed to run: the run stops with one line (exit 2), checkpoints kept."""


def episode_metrics(episodes: Sequence[EpisodeRecord | None]) -> dict[str, float]:
    """tools/* metrics of a step's episodes (all generated, dropped groups included); {} without any."""
    return _tool_stats([(e.turns, [c.status for c in e.calls], e.tool_seconds, e.turn_capped, e.tool_tokens)
                        for e in episodes if e is not None])


def check_call_close(fmt: CallFormat, tokenizer: Tokenizer) -> int:
    """The one token id of the format's call end (generation stops on it).

    Raises:
        UserError: the marker is several tokens of this tokenizer (or none).
    """
    close = tokenizer.encode(fmt.call_close)
    if len(close) != 1:
        raise UserError(f"tools.format={fmt.name}: the call's end {fmt.call_close!r} is {len(close)} tokens of this "
                        "tokenizer, and generation can only stop on one; use a format whose markers are tokens "
                        "of the model's tokenizer (tags: the embedded task's; hermes: Qwen's)")
    return close[0]


class EpisodeRunner:
    """Runs multi-turn episodes over any generate function (module docstring).

    Args:
        closers: what close() calls after the last tool call: the tools' own resources (the
            custom tools' worker processes, tools/registry.tool_set), owned by the runner.
    """

    def __init__(self, settings: EpisodeSettings, tokenizer: Tokenizer, *,
                 closers: Sequence[Callable[[], None]] = ()) -> None:
        self.settings = settings
        self._closers = list(closers)
        self.tokenizer = tokenizer
        self.close_id = check_call_close(settings.fmt, tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=settings.calls_in_flight, thread_name_prefix="tool")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        closers, self._closers = self._closers, []
        for close in closers:
            close()

    def generate(self, generate: Generate, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 carried: Sequence[GenerationResult] | None = None, aborted: Callable[[], bool] | None = None,
                 ) -> list[GenerationResult]:
        """``params.n`` episodes per prompt, prompt-major, as ``generate`` would answer one turn.

        Args:
            generate: one turn for many contexts (an engine's or the controller's generate).
            prompts: the prompts' ids.
            params: sampling settings of the first turn (later turns: n=1, their own seed).
            carried: a partial rollout's group to go on with (one prompt, n results in sample
                order, from an earlier call that was aborted): results with reason abort resume
                where they stopped (mid-turn: the turn goes on; after a call whose answer never
                came: the call runs again), the others are final as they are.
            aborted: the collector's abort (streaming's full batch): once true, no further turn
                starts and no tool answer is awaited; unfinished episodes end with reason abort,
                their tokens so far kept (their state is in the tokens: a partial rollout
                resumes them with ``carried``).
        """
        s = self.settings
        aborted = aborted or (lambda: False)
        params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, self.close_id),
                                     max_new_tokens=min(params.max_new_tokens, s.max_response_tokens))
        budget = s.max_response_tokens
        if carried is None:
            first = generate(prompts, params)
            episodes = [_Episode(list(prompts[r.prompt_index]), r.prompt_index, r.sample_index, self.close_id)
                        for r in first]
            for e, r in zip(episodes, first, strict=True):
                e.add_turn(r, budget, budget)
        else:
            assert len(prompts) == 1, "a carried group is one prompt's"
            episodes = [_Episode.resume(list(prompts[0]), r, self.close_id, budget) for r in carried]
        turn = 1
        while True:
            for e in episodes:
                if e.next == "call" and e.turns >= s.max_turns:
                    e.stop("length", capped=True)
            self._answer([e for e in episodes if e.next == "call"], aborted)
            ongoing = [e for e in episodes if e.next in ("turn", "continue")]
            if not ongoing:
                break
            if aborted():
                for e in ongoing:
                    e.stop("abort")
                break
            room = max(budget - len(e.out) for e in ongoing)
            seed = None if params.seed is None else (params.seed * 1_000_003 + 7919 * turn) % (2**31 - 1)
            more = generate([e.prompt + e.out for e in ongoing],
                            dataclasses.replace(params, n=1, max_new_tokens=room, seed=seed))
            for r in more:
                e = ongoing[r.prompt_index]
                e.add_turn(r, budget - len(e.out), budget)
            turn += 1
        results = [e.result() for e in episodes]
        self._check_failures(results)
        return results

    def _answer(self, episodes: list[_Episode], aborted: Callable[[], bool]) -> None:
        """Run the calls the episodes' last turns ended on, ``calls_in_flight`` at once, and
        append each answer. An abort stops the wait: an episode whose answer had not come ends
        with reason abort, and its call runs again when it resumes (the call still running
        finishes by its own deadline, its answer unused)."""
        if not episodes:
            return
        futures = [self._pool.submit(self._call, self.tokenizer.decode(e.last_turn)) for e in episodes]
        waiting = set(futures)
        while waiting:
            _, waiting = wait(waiting, timeout=_ABORT_POLL_S)
            if waiting and aborted():
                break
        for future, e in zip(futures, episodes):  # in episode order: never dependent on timing
            if future in waiting:
                future.cancel()
                e.stop("abort")
            else:
                e.add_answer(*future.result(), self.settings.max_response_tokens)

    def _check_failures(self, results: list[GenerationResult]) -> None:
        calls = [c for r in results for c in r.episode.calls]  # type: ignore[union-attr]
        failed = [c for c in calls if c.status == "failed"]
        if len(calls) >= 16 and len(failed) > self.settings.max_failure_fraction * len(calls):
            raise ToolPoolBroken(
                f"tools: {len(failed)} of {len(calls)} tool calls failed to run (e.g. {failed[0].tool}: "
                f"{failed[0].answer[:200]}); fix the tool or raise tools.max_failure_fraction")

    def _call(self, turn_text: str) -> tuple[ToolCallRecord, list[int]]:
        """Run the call at the end of a turn; its record and the answer's token ids (cut to the cap)."""
        s = self.settings
        call = s.fmt.parse(turn_text)
        result = self._run(call)
        status = "malformed" if call.error else result.status
        text = pad_result(self._bounded(result.text), s.result_width)
        record = ToolCallRecord(tool=call.tool, argument=call.argument, status=status, answer=text,
                                seconds=result.seconds, isolation=result.isolation)
        return record, self._answer_ids(text)

    def _run(self, call: ParsedCall) -> ToolResult:
        if call.error:
            return ToolResult(f"error: {call.error}", "error", 0.0)
        tool = self.settings.tools.get(call.tool)
        if tool is None:
            return ToolResult(f"error: no tool named {call.tool!r} (tools: {', '.join(sorted(self.settings.tools))})",
                              "error", 0.0)
        start = time.monotonic()
        try:
            return tool(call.argument)
        except Exception as err:  # a tool's own bug is the policy's error text, never the trainer's crash
            return ToolResult(f"error: the tool failed ({type(err).__name__}: {err})", "failed",
                              time.monotonic() - start)

    def _bounded(self, text: str) -> str:
        """A tool's text made safe to keep and tokenize: at most ``_CHARS_PER_TOKEN`` characters per
        token of the cap at each end (the middle cut), lone surrogates as U+FFFD."""
        keep = _CHARS_PER_TOKEN * self.settings.max_tool_output_tokens
        if not isinstance(text, str):
            text = repr(text)
        if len(text) > 2 * keep + len(_CUT):
            text = text[:keep] + _CUT + text[-keep:]
        return _SURROGATE.sub("\ufffd", text)

    def _answer_ids(self, text: str) -> list[int]:
        """``result_open + text + result_close`` as ids, the text (already ``_bounded``) cut in the
        middle to fit the cap."""
        fmt, cap = self.settings.fmt, self.settings.max_tool_output_tokens
        head, tail = self.tokenizer.encode(fmt.result_open), self.tokenizer.encode(fmt.result_close)
        body = self.tokenizer.encode(text)
        room = cap - len(head) - len(tail)
        if len(body) > room:
            marker = self.tokenizer.encode(_CUT)
            keep = max(0, room - len(marker))
            body = body[: (keep + 1) // 2] + marker + (body[len(body) - keep // 2:] if keep // 2 else [])
            body = body[:room]
        return head + body + tail
