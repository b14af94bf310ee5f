"""One check of multi-turn token exactness for every engine (issue 40): tests/*/test_*_episodes.py.

A random tiny model does not write ``</calc>``, so the check makes it call: the call's end marker is
the token the engine samples most often in a first plain batch, and the tool answers with fixed
ids. The episodes then cross turns on real engines; every policy token's log-prob must equal
transformers' float32 log-prob of it given everything before it (prompt, earlier turns and the
tool's tokens, as ids), and every tool token has mask 0 and log-prob 0.0.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from model_utils import reference_log_probs

from megatron_dapo.rollout.engine import GenerationResult, SamplingParams
from megatron_dapo.tools.episode import EpisodeRunner, EpisodeSettings
from megatron_dapo.tools.formats import CallFormat
from megatron_dapo.tools.sandbox import ToolResult

PROMPTS = [[5, 17, 42, 8], [3, 9, 11], [60, 61, 62, 63]]
ANSWER_IDS = [21, 22, 23]
EPISODE_PARAMS = SamplingParams(n=4, temperature=1.0, max_new_tokens=40, seed=7, stop_token_ids=(1,))
EARLY = 12
"""The call marker is a token of the episodes' first EARLY tokens: 40 - 12 leaves room for the
answer's 5 ids and a second turn."""


class IdTokenizer:
    """Text is space-separated ids; the format's markers are named ids."""

    def __init__(self, markers: dict[str, int], vocab_size: int) -> None:
        self.markers, self.names = markers, {v: k for k, v in markers.items()}
        self.vocab_size, self.eos_id, self.pad_id, self.has_chat_template = vocab_size, 1, 0, False

    def encode(self, text: str) -> list[int]:
        return [self.markers[w] if w in self.markers else int(w) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.names.get(i, str(i)) for i in ids)

    def render_chat(self, messages):  # pragma: no cover - not used
        raise NotImplementedError


def exactness_runner(generate: Callable[[Sequence[Sequence[int]], SamplingParams], list[GenerationResult]], *,
                     vocab_size: int, tool_seconds: float = 0.0) -> tuple[EpisodeRunner, int]:
    """An episode runner whose calls end on the token `generate` samples most often (and its id).

    tool_seconds: how long each call takes (a streaming abort can then catch calls in flight).
    """
    # The episodes' own first turns, as far as EARLY tokens: the same prompts, seed and stops, so
    # the episodes sample these tokens again and the marker chosen among them ends a call early
    # enough for the answer and a second turn to fit in the budget. (A marker taken from another
    # seed's draw was sampled late or not at all on an AMD Zen 4 under CI's load: two calls in
    # twelve episodes, neither with a second turn.)
    plain = generate(PROMPTS, SamplingParams(n=EPISODE_PARAMS.n, temperature=EPISODE_PARAMS.temperature,
                                             max_new_tokens=EARLY, seed=EPISODE_PARAMS.seed,
                                             stop_token_ids=EPISODE_PARAMS.stop_token_ids))
    counts = Counter(t for r in plain for t in r.output_ids if t not in ANSWER_IDS and t > 3)
    close = counts.most_common(1)[0][0]
    markers = {"<c>": 2, "</c>": close, "<r>": 3, "</r>": 4}
    tok = IdTokenizer(markers, vocab_size)
    fmt = CallFormat("ids", "", "</c>", "<r> ", " </r>", default_tool="answer")  # any turn ending on </c> calls

    def tool(_arg: str) -> ToolResult:
        time.sleep(tool_seconds)
        return ToolResult(" ".join(map(str, ANSWER_IDS)), "ok", tool_seconds)

    return EpisodeRunner(EpisodeSettings(fmt=fmt, tools={"answer": tool}, max_turns=3, max_tool_output_tokens=8,
                                         max_response_tokens=40), tok), close


def check_episode_exactness(generate: Callable[[Sequence[Sequence[int]], SamplingParams], list[GenerationResult]],
                            checkpoint, *, vocab_size: int) -> dict[str, float]:
    """Run episodes through `generate` and hold them to transformers; returns counts for the caller."""
    runner, close = exactness_runner(generate, vocab_size=vocab_size)
    try:
        results = runner.generate(generate, PROMPTS, EPISODE_PARAMS)
    finally:
        runner.close()
    return check_results(results, checkpoint, close, [PROMPTS[r.prompt_index] for r in results])


def check_results(results: Sequence[GenerationResult], checkpoint, close: int,
                  prompts: Sequence[Sequence[int]]) -> dict[str, float]:
    """Every policy token's log-prob is transformers' given everything before it; tool tokens mask 0, log-prob 0.0;
    an episode's turns are its runs of policy tokens (a turn cut by an abort and resumed stays one turn)."""
    answered = [r for r in results if r.episode.calls]
    assert answered, "no episode called the tool; the check needs some"
    policy_gap, tool_tokens = 0.0, 0
    for r, prompt in zip(results, prompts, strict=True):
        mask = torch.tensor(r.episode.policy_mask, dtype=torch.bool)
        ref = reference_log_probs(checkpoint, prompt, r.output_ids, 1.0)
        engine = torch.tensor(r.logprobs)
        policy_gap = max(policy_gap, float((engine - ref).abs()[mask].max()) if mask.any() else 0.0)
        assert (engine[~mask] == 0).all()
        tool_tokens += int((~mask).sum())
        runs = sum(1 for k, m in enumerate(r.episode.policy_mask) if m and (k == 0 or not r.episode.policy_mask[k - 1]))
        assert r.episode.turns == runs, (r.episode.turns, r.episode.policy_mask)
        # Each answer sits right after a call's end, as the answer's ids (never a re-tokenization).
        ids = r.output_ids
        for k, t in enumerate(ids[:-1]):
            if t == close and r.episode.policy_mask[k] and k + 1 < len(ids) and not r.episode.policy_mask[k + 1]:
                assert ids[k + 1: k + 1 + 1] == [3]
    return {"episodes_with_calls": len(answered), "policy_gap": policy_gap, "tool_tokens": tool_tokens,
            "turns_max": max(r.episode.turns for r in results)}


def check_streamed_episodes(rollout, checkpoint, *, vocab_size: int) -> dict[str, float]:
    """Episodes through the controller's streaming path (collect/streaming.py's driver): the first
    finished group aborts the session (a full batch) while other episodes are mid-turn or mid-call;
    the incomplete ones are then resumed as a partial rollout. Every episode, finished or resumed,
    must be token-exact."""
    from megatron_dapo.collect.streaming import _episodes_driver
    from megatron_dapo.rollout.streaming import CarriedPrompt, PromptFeed

    runner, close = exactness_runner(rollout.engines[0].generate, vocab_size=vocab_size, tool_seconds=0.3)
    drive = _episodes_driver(runner)
    try:
        groups: list[list[GenerationResult]] = []

        def first_fills(group: list[GenerationResult]) -> None:
            groups.append(group)
            feed.close()
            rollout.abort()

        feed = PromptFeed(iter(PROMPTS * 2))
        incomplete = rollout.stream(feed, EPISODE_PARAMS, first_fills, max_inflight=4, drive=drive)
        assert len(groups) >= 1 and incomplete, "the abort left nothing to resume; the check needs some"
        assert all(r.episode is not None for r in incomplete)
        cut = [r for r in incomplete if r.finish_reason == "abort"]
        assert cut, "no episode was cut by the abort"
        by_index: dict[int, list[GenerationResult]] = {}
        for r in incomplete:
            by_index.setdefault(r.prompt_index, []).append(r)
        order = sorted(by_index)
        carried = iter([CarriedPrompt(prompt=(PROMPTS * 2)[i], results=tuple(sorted(by_index[i], key=lambda r: r.sample_index)))
                        for i in order])
        resumed: list[list[GenerationResult]] = []
        rollout.stream(PromptFeed(carried), EPISODE_PARAMS, resumed.append, max_inflight=4, drive=drive)
    finally:
        runner.close()
    finished = [r for g in groups for r in g]
    prompts = [(PROMPTS * 2)[r.prompt_index] for r in finished]
    prompts += [(PROMPTS * 2)[order[r.prompt_index]] for g in resumed for r in g]
    out = check_results([*finished, *(r for g in resumed for r in g)], checkpoint, close, prompts)
    assert all(r.finish_reason != "abort" for g in resumed for r in g)
    return {**out, "cut": len(cut), "cut_mid_call": sum(1 for r in cut if r.output_ids and r.output_ids[-1] == close
                                                          and r.episode.policy_mask[-1]),
            "cut_with_tokens": sum(1 for r in cut if r.output_ids)}
