"""The episode driver (issue 40): turns, tool segments, masks, budgets, caps, failures.

A scripted engine answers each turn from a queue per episode (what it would sample), recording
every prompt it was given, so the tests see exactly which ids went in: the prompt plus every
earlier segment, never a re-tokenization of the policy's ids.
"""

from __future__ import annotations

import tempfile

import pytest

from megatron_dapo.data.tokenizer import SentencePieceSettings, load_or_train_sentencepiece
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.engine import GenerationResult, SamplingParams
from megatron_dapo.tools.calculator import run_calculator
from megatron_dapo.tools.episode import EpisodeRunner, EpisodeSettings
from megatron_dapo.tools.formats import FORMATS
from megatron_dapo.tools.sandbox import ToolResult

MARKERS = ("<calc>", "</calc>", "<result>", "</result>")


@pytest.fixture(scope="module")
def tok():
    texts = ["12+34=46", "<calc>12*34</calc><result>408</result> so 408", "what is 5*6? answer 30"] * 50
    return load_or_train_sentencepiece(texts, tempfile.mkdtemp(),
                                       SentencePieceSettings(vocab_size=300, user_defined_symbols=MARKERS))


class Scripted:
    """generate(): each response takes the next text of its episode's script; logprob -0.1 per token."""

    def __init__(self, tok, scripts: dict[tuple[int, int], list[str]]):
        self.tok, self.scripts, self.calls = tok, {k: list(v) for k, v in scripts.items()}, []
        self.origin: dict[tuple[int, ...], tuple[int, int]] = {}

    def __call__(self, prompts, params: SamplingParams) -> list[GenerationResult]:
        self.calls.append(([list(p) for p in prompts], params))
        out = []
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                key = (i, j) if len(self.calls) == 1 else self.origin[tuple(prompt)]
                ids = self.tok.encode(self.scripts[key].pop(0))
                stop = next((k for k, t in enumerate(ids) if t in params.stop_token_ids), None)
                reason = "stop" if stop is not None else "length"
                ids = ids[: stop + 1] if stop is not None else ids[: params.max_new_tokens]
                if len(ids) > params.max_new_tokens:
                    ids, reason = ids[: params.max_new_tokens], "length"
                out.append(GenerationResult(prompt_index=i, sample_index=j, output_ids=ids,
                                            logprobs=[-0.1] * len(ids), finish_reason=reason))
                self.last = (tuple(prompt), ids, key)
                self.origin[tuple([*prompt, *ids])] = key
        return out


def _runner(tok, **kw) -> EpisodeRunner:
    settings = dict(fmt=FORMATS["tags"], tools={"calculator": run_calculator}, max_turns=4,
                    max_tool_output_tokens=16, max_response_tokens=64)
    return EpisodeRunner(EpisodeSettings(**{**settings, **kw}), tok)


def test_a_call_is_answered_and_generation_continues_from_the_ids(tok):
    prompt = tok.encode("what is 12*34?")
    engine = Scripted(tok, {(0, 0): ["<calc>12*34</calc>", " so 408"], (0, 1): ["408"]})
    runner = _runner(tok)
    # The continuation's prompt is the first turn's prompt + its ids + the answer's ids.
    first_turn = tok.encode("<calc>12*34</calc>")
    answer = tok.encode("<result>408</result>")
    engine.origin[tuple([*prompt, *first_turn, *answer])] = (0, 0)
    out = runner.generate(engine, [prompt], SamplingParams(n=2, max_new_tokens=64, stop_token_ids=(3,)))
    a, b = out
    assert a.output_ids == first_turn + answer + tok.encode(" so 408")
    assert a.episode.policy_mask == tuple([1] * len(first_turn) + [0] * len(answer) + [1] * len(tok.encode(" so 408")))
    assert [lp for lp, m in zip(a.logprobs, a.episode.policy_mask) if not m] == [0.0] * len(answer)
    assert a.episode.turns == 2 and [c.answer for c in a.episode.calls] == ["408"]
    assert b.episode.turns == 1 and b.episode.calls == () and b.output_ids == tok.encode("408")
    # The second turn was sent exactly the ids, one row (n=1), the stop token of the call format added.
    prompts, params = engine.calls[1]
    assert prompts == [[*prompt, *first_turn, *answer]] and params.n == 1
    assert runner.close_id in params.stop_token_ids and 3 in params.stop_token_ids


def test_failures_become_the_policys_error_text(tok):
    def broken(_: str) -> ToolResult:
        raise RuntimeError("boom")

    prompt = tok.encode("what is 5*6?")
    runner = _runner(tok, tools={"calculator": broken}, max_turns=2, max_tool_output_tokens=60)
    engine = Scripted(tok, {(0, 0): ["<calc>5*6</calc>", "30"]})
    text = "error: the tool failed (RuntimeError: boom)"
    engine.origin[tuple([*prompt, *tok.encode("<calc>5*6</calc>"), *runner._answer_ids(text)])] = (0, 0)
    [r] = runner.generate(engine, [prompt], SamplingParams(n=1, max_new_tokens=64))
    assert r.episode.calls[0].status == "failed" and r.episode.tool_errors == 1
    assert tok.decode(r.output_ids).startswith("<calc>5*6</calc><result>error: the tool failed")


def test_a_malformed_call_and_an_unknown_tool_are_answered_with_errors(tok):
    runner = _runner(tok)
    assert runner._call("12*34</calc>")[0].status == "malformed"
    hermes = FORMATS["hermes"]
    assert hermes.parse('<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>').tool == "shell"
    record, _ = EpisodeRunner(EpisodeSettings(fmt=FORMATS["tags"], tools={}), tok)._call("<calc>1</calc>")
    assert record.status == "error" and "no tool named 'calculator'" in record.answer


def test_long_answers_are_cut_in_the_middle_to_the_cap(tok):
    runner = _runner(tok, max_tool_output_tokens=12)
    ids = runner._answer_ids("1234567890" * 5)
    assert len(ids) <= 12 and ids[0] == tok.encode("<result>")[0] and ids[-1] == tok.encode("</result>")[0]
    text = tok.decode(ids)
    assert text.startswith("<result>1") and " ... " in text and text.endswith("0</result>")


def test_the_turn_cap_and_the_budget_end_episodes_as_length(tok):
    prompt = tok.encode("what is 5*6?")
    call = tok.encode("<calc>5*6</calc>")
    runner = _runner(tok, max_turns=1)
    engine = Scripted(tok, {(0, 0): ["<calc>5*6</calc>"]})
    [r] = runner.generate(engine, [prompt], SamplingParams(n=1, max_new_tokens=64))
    assert r.finish_reason == "length" and r.episode.turn_capped and r.output_ids == call and not r.episode.calls
    # Budget: the answer does not fit in what is left of max_response_tokens.
    runner = _runner(tok, max_response_tokens=len(call) + 2)
    engine = Scripted(tok, {(0, 0): ["<calc>5*6</calc>"]})
    [r] = runner.generate(engine, [prompt], SamplingParams(n=1, max_new_tokens=64))
    assert r.finish_reason == "length" and len(r.output_ids) == len(call) + 2 and not r.episode.turn_capped
    assert r.episode.policy_mask == tuple([1] * len(call) + [0, 0])


def test_a_close_marker_of_several_tokens_is_refused(tok):
    fmt = FORMATS["hermes"]  # </tool_call> is not one piece of this tokenizer
    with pytest.raises(UserError, match=r"tools\.format=hermes: the call's end '</tool_call>' is"):
        EpisodeRunner(EpisodeSettings(fmt=fmt, tools={}), tok)
