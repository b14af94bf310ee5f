"""A remote SGLang engine that dies or stops answering mid-generate fails the controller's
generate fast with an EngineError naming the engine and where its log is, instead of holding
the controller, and every rank waiting for it, until the request's timeout (an hour by
default). The server is a real process (tests/unit/fake_sglang_server.py) that is killed.

That error then ends every rank like any failure of rank 0 in the rollout phase
(tests/e2e/test_rank_faults.py, rollout:0).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import EngineError, SamplingParams
from megatron_dapo.rollout.sglang.engine import SGLangEngine

FAKE_SERVER = Path(__file__).with_name("fake_sglang_server.py")
LOG = "node1:/runs/x/engine_logs/{name}.log (owned by rank 8)"


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[[float], tuple[subprocess.Popen, str]]]:
    started: list[subprocess.Popen] = []

    def start(generate_s: float) -> tuple[subprocess.Popen, str]:
        port_file = tmp_path / f"port{len(started)}"
        proc = subprocess.Popen([sys.executable, str(FAKE_SERVER), str(port_file), str(generate_s)])
        started.append(proc)
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.02)
        return proc, f"http://127.0.0.1:{port_file.read_text()}"

    yield start
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)  # also ends a SIGSTOPped one
            proc.wait(timeout=30)


def _remote(url: str, name: str, **kwargs) -> SGLangEngine:
    """The controller's client of an engine another rank owns (colocated.py's `client`)."""
    settings = {"request_timeout_s": 600.0, "health_check_interval_s": 0.5, "health_check_failures": 3, **kwargs}
    return SGLangEngine(url, name=name, api_key="k", log_location=LOG.format(name=name), **settings)


def _generate_in_thread(generate: Callable[[], object], bound_s: float) -> tuple[BaseException | None, float]:
    """Run `generate`; fail the test instead of hanging when it outlives bound_s."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            generate()
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not thread.is_alive(), f"generate still waiting {bound_s:.0f} s after the server stopped"
    return outcome[0], time.monotonic() - start


PROMPTS = [[1, 2], [3]]


def test_a_server_killed_mid_generate_fails_it_at_once_naming_the_engine(start_server) -> None:
    proc, url = start_server(60.0)
    engine = _remote(url, "sglang1")
    threading.Timer(1.0, proc.kill).start()
    error, seconds = _generate_in_thread(lambda: engine.generate(PROMPTS, SamplingParams(n=2)), bound_s=30)
    assert isinstance(error, EngineError), error
    assert str(error).startswith(f"SGLang engine sglang1: POST {url}/generate failed after 1 attempts"), error
    assert str(error).endswith(f"; server log: {LOG.format(name='sglang1')}")
    assert seconds < 10, seconds
    # Later calls, once the process is gone (its exit closes the in-flight socket, which ended the
    # first call, a moment before the listening one), meet a refused connection: an EngineError
    # at once, no retrying.
    proc.wait(timeout=10)
    error, seconds = _generate_in_thread(lambda: engine.generate(PROMPTS, SamplingParams()), bound_s=30)
    assert isinstance(error, EngineError) and "Connection refused" in str(error), error
    assert seconds < 5, seconds


def test_a_server_that_stops_answering_mid_generate_is_abandoned_after_its_health_checks(start_server) -> None:
    # SIGSTOP: the socket stays open and nothing answers, as with a wedged scheduler or a lost node.
    proc, url = start_server(60.0)
    engine = _remote(url, "sglang1")
    threading.Timer(1.0, os.kill, (proc.pid, signal.SIGSTOP)).start()
    # Before: the request waited for request_timeout_s (600 s here, 3600 by default).
    error, seconds = _generate_in_thread(lambda: engine.generate(PROMPTS, SamplingParams()), bound_s=60)
    assert isinstance(error, EngineError), error
    message = str(error)
    assert message.startswith("SGLang engine sglang1: /generate abandoned after "), message
    assert f"{url}/health_generate failed 3 times in a row meanwhile" in message
    assert message.endswith(f"; server log: {LOG.format(name='sglang1')}")
    assert seconds < 20, seconds


def test_the_controller_aborts_the_live_engines_not_the_hung_one(start_server) -> None:
    hung_proc, hung_url = start_server(60.0)
    _, live_url = start_server(60.0)
    # An abort sent to the hung engine would wait 3 x 20 s for it.
    controller = RolloutController([_remote(hung_url, "sglang0", control_timeout_s=20.0),
                                    _remote(live_url, "sglang1", control_timeout_s=20.0)])
    threading.Timer(1.0, os.kill, (hung_proc.pid, signal.SIGSTOP)).start()
    error, seconds = _generate_in_thread(lambda: controller.generate(PROMPTS, SamplingParams()), bound_s=120)
    assert isinstance(error, EngineError) and str(error).startswith("SGLang engine sglang0: /generate abandoned"), error
    # The live engine's generate ended through its abort, not after its 60 s.
    assert seconds < 20, seconds


def test_a_shutdown_during_a_relaunch_ends_it_and_stops_the_fresh_server(tmp_path: Path) -> None:
    """As for vLLM (test_rollout_vllm.py): a run ending while the controller relaunches a server it
    launched does not wait up to startup_timeout_s for it; the fresh process is stopped. The
    "server" is a real process that never answers (its interpreter sleeps, the server's argv ignored)."""
    import dataclasses

    from model_utils import make_tiny_checkpoint
    from proc_utils import shut_down_mid_relaunch

    from megatron_dapo.rollout.sglang.server import SGLangServerConfig

    model = make_tiny_checkpoint(tmp_path / "tiny")
    first, sleeper = tmp_path / "first.py", tmp_path / "sleeper.py"
    for script in (first, sleeper):
        script.write_text("import time\ntime.sleep(300)\n")
    config = SGLangServerConfig(model_path=str(model), device="cpu", dtype="float32", max_total_tokens=256,
                                log_path=str(tmp_path / "sglang0.log"), launcher=(sys.executable, str(first)))
    engine = SGLangEngine.start(config, name="sglang0")
    engine._relaunch["config"] = dataclasses.replace(engine._relaunch["config"], launcher=(sys.executable, str(sleeper)))
    still_waiting, failure, left = shut_down_mid_relaunch(lambda: engine.relaunch(startup_timeout_s=600), engine.shutdown, str(sleeper))
    assert not still_waiting, "the relaunch kept waiting for its server after shutdown"
    assert len(failure) == 1 and isinstance(failure[0], EngineError), failure
    assert "shut down while it started" in str(failure[0])
    assert left == 0, "the fresh server outlived the shutdown"
