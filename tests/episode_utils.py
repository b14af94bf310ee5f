"""One check of multi-turn token exactness for every engine (issue 40): tests/*/test_*_episodes.py.

A random tiny model does not write ``</calc>``, so the check makes it call: the call's end marker is
the token the engine samples most often in a first plain batch, and the tool answers with fixed
ids. The episodes then cross turns on real engines; every policy token's log-prob must equal
transformers' float32 log-prob of it given everything before it (prompt, earlier turns and the
tool's tokens, as ids), and every tool token has mask 0 and log-prob 0.0.
"""

from __future__ import annotations

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


def check_episode_exactness(generate: Callable[[Sequence[Sequence[int]], SamplingParams], list[GenerationResult]],
                            checkpoint, *, vocab_size: int) -> dict[str, float]:
    """Run episodes through `generate` and hold them to transformers; returns counts for the caller."""
    plain = generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=5))
    counts = Counter(t for r in plain for t in r.output_ids if t not in ANSWER_IDS and t > 3)
    close = counts.most_common(1)[0][0]
    markers = {"<c>": 2, "</c>": close, "<r>": 3, "</r>": 4}
    tok = IdTokenizer(markers, vocab_size)
    fmt = CallFormat("ids", "", "</c>", "<r> ", " </r>", default_tool="answer")  # any turn ending on </c> calls
    tool = lambda _arg: ToolResult(" ".join(map(str, ANSWER_IDS)), "ok", 0.0)  # noqa: E731
    runner = EpisodeRunner(EpisodeSettings(fmt=fmt, tools={"answer": tool}, max_turns=3, max_tool_output_tokens=8,
                                           max_response_tokens=40), tok)
    try:
        results = runner.generate(generate, PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=40, seed=7,
                                                                    stop_token_ids=(1,)))
    finally:
        runner.close()
    answered = [r for r in results if r.episode.calls]
    assert answered, "no episode called the tool; the check needs some"
    policy_gap, tool_tokens = 0.0, 0
    for r in results:
        mask = torch.tensor(r.episode.policy_mask, dtype=torch.bool)
        ref = reference_log_probs(checkpoint, PROMPTS[r.prompt_index], r.output_ids, 1.0)
        engine = torch.tensor(r.logprobs)
        policy_gap = max(policy_gap, float((engine - ref).abs()[mask].max()) if mask.any() else 0.0)
        assert (engine[~mask] == 0).all()
        tool_tokens += int((~mask).sum())
        # Each answer sits right after a call's end, as the answer's ids (never a re-tokenization).
        ids = r.output_ids
        for k, t in enumerate(ids[:-1]):
            if t == close and r.episode.policy_mask[k] and k + 1 < len(ids) and not r.episode.policy_mask[k + 1]:
                assert ids[k + 1: k + 1 + 1] == [3]
    return {"episodes_with_calls": len(answered), "policy_gap": policy_gap, "tool_tokens": tool_tokens,
            "turns_max": max(r.episode.turns for r in results)}
