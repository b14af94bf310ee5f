"""Custom tools (tools/custom.py): a user's function answers calls from worker processes; what it
raises, a hang past the deadline and a dead worker become failed answers, the pool keeps working,
calls from many threads run at once, bad specs are one line, and a tool that always fails stops
the run through the episode runner's breaker."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import tool_fns_for_tests
from proc_utils import alive

from megatron_dapo.config.fields import ConfigError
from megatron_dapo.config.loader import load_config
from megatron_dapo.config.tools import ToolsConfig
from megatron_dapo.data.tokenizer import SentencePieceSettings, load_or_train_sentencepiece
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.engine import GenerationResult, SamplingParams
from megatron_dapo.tools.custom import MAX_ANSWER_CHARS, CustomToolPool
from megatron_dapo.tools.episode import ToolPoolBroken
from megatron_dapo.tools.registry import episode_runner, tool_set

HELPERS = tool_fns_for_tests.__name__
TIMEOUT_S = 1.0
SPECS = {"shout": f"{HELPERS}:shout", "misbehave": f"{HELPERS}:misbehave", "nap": f"{HELPERS}:nap"}


@pytest.fixture(scope="module")
def pool() -> Iterator[CustomToolPool]:
    """Two workers of the helpers, shared by the tests that do not count workers (starting is the slow part)."""
    with CustomToolPool(SPECS, num_workers=2, timeout_s=TIMEOUT_S) as p:
        yield p


def _pid(answer: str) -> int:
    return int(answer.rsplit(" ", 1)[1])


def test_a_custom_tool_answers_directly_and_through_the_registry(pool: CustomToolPool) -> None:
    result = pool.call("shout", "hello")
    assert (result.status, result.text.split(" from ")[0]) == ("ok", "HELLO")
    cfg = ToolsConfig(tools=["calculator", f"{HELPERS}:shout", f"loud={HELPERS}:shout"], custom_workers=1)
    tools, closers = tool_set(cfg)
    try:
        assert sorted(tools) == ["calculator", "loud", "shout"]
        assert tools["calculator"]("6*7").text == "42"
        shout, loud = tools["shout"]("abc"), tools["loud"]("xyz")
        assert (shout.status, shout.text.split(" from ")[0]) == ("ok", "ABC")
        assert (loud.status, loud.text.split(" from ")[0]) == ("ok", "XYZ")
    finally:
        for close in closers:
            close()
    assert tools["shout"]("abc").status == "failed"  # closed with the set


@pytest.mark.parametrize(("argument", "text"), [
    ("raise", "error: ValueError: cannot answer 'raise'"),
    ("int", "error: TypeError: the tool returned int 7, not a str"),
])
def test_a_raise_or_a_non_str_answer_fails_with_its_error_and_the_pool_keeps_working(
        pool: CustomToolPool, argument: str, text: str) -> None:
    result = pool.call("misbehave", argument)
    assert (result.status, result.text) == ("failed", text)
    assert [pool.call("misbehave", "fine").text for _ in range(3)] == ["ok"] * 3


def test_a_flood_of_an_answer_is_cut_in_the_worker(pool: CustomToolPool) -> None:
    result = pool.call("misbehave", "flood")
    assert result.status == "ok" and len(result.text) <= MAX_ANSWER_CHARS
    head, cut, tail = result.text.partition(" ... ")
    assert cut and set(head) == set(tail) == {"7"} and len(head) == len(tail) >= MAX_ANSWER_CHARS // 2 - 5


def test_what_a_tool_starts_in_a_session_of_its_own_ends_with_the_pool(tmp_path) -> None:
    pid_file = tmp_path / "daemon.pid"
    with CustomToolPool({"daemon": f"{HELPERS}:daemon"}, num_workers=1, timeout_s=10.0) as pool:
        assert pool.call("daemon", str(pid_file)).text == "started"
        deadline = time.monotonic() + 10
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        assert alive(pid)
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not alive(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_call_past_the_deadline_fails_in_time_and_its_worker_is_replaced() -> None:
    with CustomToolPool(SPECS, num_workers=1, timeout_s=TIMEOUT_S) as one:
        before = _pid(one.call("shout", "a").text)
        start = time.monotonic()
        result = one.call("nap", "30")  # without the deadline: "rested" after 30 s
        elapsed = time.monotonic() - start
        assert (result.status, result.text) == ("failed", "error: the tool timed out after 1 s")
        # Past the deadline by at most a loaded machine's process start; the nap without it: 30 s.
        assert TIMEOUT_S <= elapsed < TIMEOUT_S + 15.0
        after = one.call("shout", "b")  # the only worker: answered by its replacement
        assert after.status == "ok" and _pid(after.text) != before and not alive(before)


def test_a_worker_that_dies_fails_its_call_and_is_replaced() -> None:
    with CustomToolPool(SPECS, num_workers=1, timeout_s=5.0) as one:
        before = _pid(one.call("shout", "a").text)
        result = one.call("misbehave", "die")
        assert (result.status, result.text) == ("failed", "error: worker process died (exit code 3)")
        after = one.call("shout", "b")
        assert after.status == "ok" and _pid(after.text) != before


def test_calls_from_many_threads_run_at_once_across_workers_and_reach_their_caller(pool: CustomToolPool) -> None:
    start = time.monotonic()
    with ThreadPoolExecutor(8) as threads:
        naps = list(threads.map(lambda _: pool.call("nap", "0.75"), range(8)))
    elapsed = time.monotonic() - start
    assert [r.text for r in naps] == ["rested"] * 8
    # Two at a time: 4 rounds of 0.75 s (under the pool's 1 s deadline); one at a time: 6 s. The
    # 2 s between is a loaded machine's.
    assert 3.0 <= elapsed < 5.0
    # Each caller gets its own call's answer, with raising calls interleaved.
    with ThreadPoolExecutor(16) as threads:
        answers = list(threads.map(lambda i: pool.call("shout" if i % 3 else "misbehave", f"c{i}" if i % 3 else
                                                       "raise"), range(48)))
    assert [a.text.split(" from ")[0] if i % 3 else a.status for i, a in enumerate(answers)] == \
        ["failed" if i % 3 == 0 else f"C{i}" for i in range(48)]


def test_close_fails_waiting_calls_and_stops_the_workers() -> None:
    p = CustomToolPool(SPECS, num_workers=1, timeout_s=30.0)
    pids = [w.process.pid for w in p._workers]
    waiting = ThreadPoolExecutor(1).submit(p.call, "nap", "20")
    time.sleep(0.3)
    p.close()
    assert waiting.result(timeout=10).text == "error: the tool pool is closed"
    assert p.call("shout", "x").status == "failed" and not any(alive(pid) for pid in pids)


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_tool_module:f", "tool 'no_such_tool_module:f': module 'no_such_tool_module' not found; expected a "
     "built-in tool (calculator, python) or 'package.module:function' with the module importable from PYTHONPATH"),
    (f"{HELPERS}:nothing", f"tool '{HELPERS}:nothing': module '{HELPERS}' has no attribute 'nothing'; expected a "
     "built-in tool (calculator, python) or 'package.module:function' with the module importable from PYTHONPATH"),
    (f"{HELPERS}:NOT_CALLABLE", f"tool '{HELPERS}:NOT_CALLABLE': {HELPERS}.NOT_CALLABLE is of type int, not callable; "
     "point the spec at a function f(argument: str) -> str"),
    (f"{HELPERS}:two_arguments", f"tool '{HELPERS}:two_arguments': cannot be called as f(argument) (missing a "
     "required argument: 'other'); give it the signature f(argument: str) -> str"),
])
def test_a_bad_spec_is_one_line_when_the_tool_set_is_built(spec: str, message: str) -> None:
    with pytest.raises(UserError) as info:
        tool_set(ToolsConfig(tools=[spec], custom_workers=1))
    suffix = " (in a worker process: the module must be importable by name from a fresh interpreter, not __main__)"
    assert str(info.value) == message + suffix and "\n" not in str(info.value)


@pytest.mark.parametrize(("override", "message"), [
    ("tools.tools=[calc]", "command line: tools.tools=['calc']: has ['calc']; expected built-in tools ['calculator', "
     "'python'] or custom tools 'package.module:function' (or 'name=package.module:function')"),
    ("tools.tools=['a.b:shout', 'c:shout']", "command line: tools.tools=['a.b:shout', 'c:shout']: has two tools named "
     "'shout' ('a.b:shout' and 'c:shout'); name one of them with 'name=package.module:function'"),
    ("tools.tools=[calculator, 'calculator=a:f']", "command line: tools.tools=['calculator', 'calculator=a:f']: has "
     "two tools named 'calculator' ('calculator' and 'calculator=a:f'); name one of them with "
     "'name=package.module:function'"),
    ("tools.tools=['a-b:f']", "command line: tools.tools=['a-b:f']: has 'a-b:f': a custom tool is "
     "'package.module:function' (or 'name=package.module:function') with Python names"),
    ("tools.custom_workers=0", "command line: tools.custom_workers=0: must be >= 1"),
    ("tools.custom_timeout_s=0", "command line: tools.custom_timeout_s=0: must be > 0"),
])
def test_bad_tool_entries_and_settings_are_one_line_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value) == message


def test_a_custom_tool_is_named_by_its_function_or_by_name_equals() -> None:
    cfg = ToolsConfig(tools=["calculator", "pkg.mod:lookup", "search=pkg.mod:lookup"])
    assert cfg.custom_tools() == {"lookup": "pkg.mod:lookup", "search": "pkg.mod:lookup"}


@pytest.fixture(scope="module")
def tok():
    texts = ["12+34=46", "<calc>12*34</calc><result>408</result> so 408", "what is 5*6? answer 30"] * 50
    return load_or_train_sentencepiece(texts, tempfile.mkdtemp(), SentencePieceSettings(
        vocab_size=300, user_defined_symbols=("<calc>", "</calc>", "<result>", "</result>")))


def test_a_custom_tool_that_always_raises_stops_the_run_and_the_runner_closes_its_pool(tok) -> None:
    cfg = ToolsConfig(enable=True, tools=[f"calculator={HELPERS}:always_raise"], custom_workers=2,
                      max_tool_output_tokens=60)
    runner = episode_runner(cfg, tok, 64)
    custom = runner.settings.tools["calculator"].func.__self__
    pids = [w.process.pid for w in custom._workers]
    turns = {0: "<calc>5*6</calc>", 1: "30"}

    def generate(prompts, params: SamplingParams) -> list[GenerationResult]:
        turn = 0 if params.n > 1 else 1  # the first turn samples n per prompt; continuations one each
        ids = tok.encode(turns[turn])
        return [GenerationResult(prompt_index=i, sample_index=j, output_ids=ids, logprobs=[-0.1] * len(ids),
                                 finish_reason="stop") for i in range(len(prompts)) for j in range(params.n)]

    try:
        with pytest.raises(ToolPoolBroken) as info:
            runner.generate(generate, [tok.encode("what is 5*6?")], SamplingParams(n=16, max_new_tokens=64))
        assert str(info.value) == ("tools: 16 of 16 tool calls failed to run (e.g. calculator: error: RuntimeError: "
                                   "the service is down); fix the tool or raise tools.max_failure_fraction")
    finally:
        runner.close()
    assert custom.call("calculator", "1").text == "error: the tool pool is closed"
    assert not any(alive(pid) for pid in pids)


def test_tool_workers_never_see_the_engines_key(monkeypatch) -> None:
    # spawn starts each worker with this environment (a forkserver keeps the one it started with):
    # the other variable arrives, so only the scrub keeps the key away.
    monkeypatch.setenv("VLLM_API_KEY", "engine-secret")
    monkeypatch.setenv("SGLANG_API_KEY", "engine-secret")
    monkeypatch.setenv("MEGATRON_DAPO_TEST_VISIBLE", "seen")
    with CustomToolPool({"env": f"{HELPERS}:environment_variable"}, 1, 30.0, start_method="spawn") as p:
        answers = [p.call("env", name).text for name in ("VLLM_API_KEY", "SGLANG_API_KEY", "MEGATRON_DAPO_TEST_VISIBLE")]
    assert answers == ["<unset>", "<unset>", "seen"]
