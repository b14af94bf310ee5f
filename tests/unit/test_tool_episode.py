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
from megatron_dapo.tools.formats import FORMATS, CallFormat
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


def test_answers_are_padded_to_the_result_width_and_the_record_shows_what_the_policy_saw(tok):
    # Issue 63: a small policy copies a result by its distance back; a fixed width keeps it the same.
    from megatron_dapo.tools.formats import RESULT_PAD, pad_result

    assert pad_result("408", 6) == "408" + RESULT_PAD * 3 and pad_result("123456", 6) == "123456"
    assert pad_result("1234567", 6) == "1234567" and pad_result("408", 0) == "408"
    assert FORMATS["tags"].answer("408", 5) == "<result>408__</result>"
    runner = _runner(tok, result_width=6)
    record, ids = runner._call("<calc>12*34</calc>")
    assert record.answer == "408___" and tok.decode(ids) == "<result>408___</result>"
    record, ids = runner._call("<calc>1/0</calc>")  # an error text longer than the width is left as it is
    assert record.status == "error" and RESULT_PAD not in record.answer
    assert _runner(tok)._call("<calc>12*34</calc>")[0].answer == "408"


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


def _turn(tok, text: str, reason: str = "stop", prompt_index: int = 0) -> GenerationResult:
    ids = tok.encode(text)
    return GenerationResult(prompt_index=prompt_index, sample_index=0, output_ids=ids, logprobs=[-0.1] * len(ids),
                            finish_reason=reason)


def test_an_episode_cut_mid_turn_resumes_the_same_turn_from_its_ids(tok):
    """Streaming's abort cuts a turn; the partial rollout continues that turn (one turn, not two),
    parses the call over the whole turn, and sends exactly prompt + ids so far."""
    prompt = tok.encode("what is 12*34?")
    runner = _runner(tok)
    params = SamplingParams(n=1, max_new_tokens=64)
    cut = runner.generate(lambda p, q: [_turn(tok, "<calc>12*", "abort")], [prompt], params, aborted=lambda: True)
    (r,) = cut
    assert r.finish_reason == "abort" and r.episode.turns == 1 and r.episode.calls == ()
    sent = []

    def engine(prompts, q):
        sent.append([list(p) for p in prompts])
        return [_turn(tok, "34</calc>" if len(sent) == 1 else " so 408")]

    (done,) = runner.generate(engine, [prompt], params, carried=[r])
    assert sent[0] == [prompt + tok.encode("<calc>12*")]
    assert [c.argument for c in done.episode.calls] == ["12*34"] and done.episode.calls[0].answer == "408"
    assert done.episode.turns == 2 and done.finish_reason == "stop"
    assert done.output_ids == tok.encode("<calc>12*") + tok.encode("34</calc>") + tok.encode("<result>408</result>") \
        + tok.encode(" so 408")


def test_an_episode_the_abort_cut_after_its_last_budgeted_token_resumes_as_done(tok):
    """The abort can land after a turn's last token of the budget (SGLang on CI, 2026-12-02): the
    carried episode is done (reason length) and no turn of 0 tokens is asked for."""
    prompt = tok.encode("what is 12*34?")
    runner = _runner(tok, max_response_tokens=6)
    params = SamplingParams(n=1, max_new_tokens=64)
    ids = tok.encode("12+34=46 so 408 so 408")[:6]
    assert len(ids) == 6
    cut = GenerationResult(prompt_index=0, sample_index=0, output_ids=ids, logprobs=[-0.1] * 6, finish_reason="abort")
    (r,) = runner.generate(lambda p, q: [cut], [prompt], params, aborted=lambda: True)
    assert r.finish_reason == "abort" and r.output_ids == ids
    asked = []
    (done,) = runner.generate(lambda p, q: asked.append(q) or [], [prompt], params, carried=[r])
    assert asked == [] and done.finish_reason == "length" and done.output_ids == ids and done.episode.turns == 1


def test_an_abort_during_a_tool_call_stops_the_wait_and_the_resumed_episode_runs_the_call_again(tok):
    """The collector's abort does not wait for a slow tool: the episode ends (abort) with its call
    unanswered, and the partial rollout runs that call again before the next turn."""
    import threading
    import time as _time

    runs: list[str] = []

    def slow(arg: str) -> ToolResult:
        runs.append(arg)
        _time.sleep(6.0 if len(runs) == 1 else 0.0)
        return run_calculator(arg)

    runner = _runner(tok, tools={"calculator": slow})
    prompt = tok.encode("what is 12*34?")
    params = SamplingParams(n=1, max_new_tokens=64)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    start = _time.monotonic()
    (r,) = runner.generate(lambda p, q: [_turn(tok, "<calc>12*34</calc>")], [prompt], params, aborted=stop.is_set)
    assert _time.monotonic() - start < 4.0, "the abort waited for the tool (6 s)"
    assert r.finish_reason == "abort" and r.episode.calls == () and r.episode.turns == 1
    assert r.output_ids == tok.encode("<calc>12*34</calc>") and all(r.episode.policy_mask)
    (done,) = runner.generate(lambda p, q: [_turn(tok, " so 408")], [prompt], params, carried=[r])
    assert runs == ["12*34", "12*34"] and done.episode.calls[0].answer == "408" and done.episode.turns == 2
    runner.close()


def test_an_abort_after_the_answer_resumes_with_a_new_turn_and_finished_mates_stay_as_they_are(tok):
    runner = _runner(tok)
    prompt = tok.encode("what is 12*34?")
    params = SamplingParams(n=2, max_new_tokens=64)
    mate = _turn(tok, "408")
    first = [_turn(tok, "<calc>12*34</calc>"), GenerationResult(prompt_index=0, sample_index=1,
                                                                 output_ids=mate.output_ids, logprobs=mate.logprobs,
                                                                 finish_reason="stop")]
    calls = []
    out = runner.generate(lambda p, q: calls.append(p) or first, [prompt], params, aborted=lambda: len(calls) >= 1)
    a, b = out
    assert a.finish_reason == "abort" and not a.episode.policy_mask[-1] and a.episode.calls[0].answer == "408"
    assert b.finish_reason == "stop"
    sent = []
    resumed = runner.generate(lambda p, q: sent.append(p) or [_turn(tok, " so 408")], [prompt], params, carried=out)
    assert len(sent) == 1 and sent[0] == [prompt + a.output_ids]
    assert resumed[1] == b and resumed[0].episode.turns == 2 and resumed[0].finish_reason == "stop"


def test_a_call_nested_past_the_decoders_depth_is_a_malformed_call_not_a_crash(tok):
    # Hermes' JSON calls with this tokenizer's markers (the real hermes markers are not its pieces).
    fmt = CallFormat("json-tags", "<calc>", "</calc>", "<result>", "</result>", json_calls=True, default_tool="calculator")
    runner = _runner(tok, fmt=fmt, max_turns=2, max_response_tokens=20_000)
    hostile = "<calc>" + "[" * 5000 + "</calc>"
    assert FORMATS["hermes"].parse("<tool_call>" + "[" * 5000 + "</tool_call>").error
    assert fmt.parse('<calc>{"name": ["calculator"], "arguments": {"x": "1"}}</calc>').error  # a name is a str
    prompt = tok.encode("what is 5*6?")
    engine = Scripted(tok, {(0, 0): [hostile, "30"]})
    call_ids = tok.encode(hostile)
    answer = runner._answer_ids('error: the call is not {"name": ..., "arguments": {...: "..."}}')
    engine.origin[tuple([*prompt, *call_ids, *answer])] = (0, 0)
    [r] = runner.generate(engine, [prompt], SamplingParams(n=1, max_new_tokens=20_000))
    assert [c.status for c in r.episode.calls] == ["malformed"] and r.output_ids == call_ids + answer + tok.encode("30")


class _Recording:
    """A tokenizer that records the length of every text it encodes."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def encode(self, text: str) -> list[int]:
        self.lengths.append(len(text))
        return self.tok.encode(text)

    def decode(self, ids) -> str:
        return self.tok.decode(ids)


def test_a_huge_answer_is_cut_in_characters_before_it_is_tokenized(tok):
    huge = "7" * 3_000_000

    recording = _Recording(tok)
    runner = EpisodeRunner(EpisodeSettings(fmt=FORMATS["tags"], tools={"calculator": lambda _: ToolResult(
        huge, "ok", 0.0)}, max_tool_output_tokens=16), recording)
    record, ids = runner._call("<calc>1</calc>")
    assert max(recording.lengths) <= 2 * 32 * 16 + 5 and len(ids) <= 16
    assert record.status == "ok" and len(record.answer) <= 2 * 32 * 16 + 5 and " ... " in record.answer
    assert tok.decode(ids).startswith("<result>7") and tok.decode(ids).endswith("7</result>")


def test_an_answer_with_lone_surrogates_is_answered_with_replacement_characters(tok):
    with pytest.raises(RuntimeError):  # what the tokenizer does with one, hence the guard
        tok.encode("a\udc80b")

    runner = _runner(tok, tools={"calculator": lambda _: ToolResult("4\udc80\ud8002", "ok", 0.0)}, max_turns=2)
    prompts = [tok.encode(f"what is {j}*6?") for j in range(16)]
    engine = Scripted(tok, {(i, 0): ["<calc>5*6</calc>", "30"] for i in range(16)})
    answer = runner._answer_ids("4\ufffd\ufffd2")
    for i, prompt in enumerate(prompts):
        engine.origin[tuple([*prompt, *tok.encode("<calc>5*6</calc>"), *answer])] = (i, 0)
    out = runner.generate(engine, prompts, SamplingParams(n=1, max_new_tokens=64))
    # 16 calls, none a failure of the tool (the breaker counts only those), each answered.
    assert [c.status for r in out for c in r.episode.calls] == ["ok"] * 16
    assert {c.answer for r in out for c in r.episode.calls} == {"4\ufffd\ufffd2"}
