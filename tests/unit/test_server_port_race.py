"""A server whose port another process took between free_port's pick and the server's bind is
launched again on ports picked anew; a port the user set, or any other failure, is raised at once.

CI 2026-12-04 (AMD EPYC, two xdist workers): a colocated SGLang server died at its start with
uvicorn's "[Errno 98] error while attempting to bind on address ('127.0.0.1', 37151): address
already in use" (lower case; the port check looked for Python's "Address already in use") and the
trainer ended on "1 colocated SGLang engine(s) failed to start". The vLLM engine's retry is held in
test_rollout_vllm.py. The servers here are real processes on real sockets: a launcher that binds
the command's --host/--port and answers /health_generate, or prints uvicorn's line and exits 3.
"""

from __future__ import annotations

import socket
import sys

import pytest

import megatron_dapo.rollout.sglang.server as sglang_server
from megatron_dapo.launcher import free_ports
from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.rollout.server_process import lost_port_race
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import SGLangServerConfig

SERVER = r"""
import http.server, sys
argv = sys.argv
host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
if __import__("os").environ.get("FAKE_FAIL"):
    print("RuntimeError: CUDA out of memory", flush=True)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
try:
    server = http.server.HTTPServer((host, port), Health)
except OSError as err:
    print(f"ERROR:    [Errno {err.errno}] error while attempting to bind on address ({host!r}, {port}): "
          "address already in use", flush=True)
    sys.exit(3)
print(f"serving on {port}", flush=True)
server.serve_forever()
"""


@pytest.fixture
def taken_port():
    """A port another socket holds. Bound, not listening: the server's bind fails as beside a second
    server, and the engine's health probe is refused at once instead of waiting on a listener
    that never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


def _config(tmp_path, **kw) -> SGLangServerConfig:
    return SGLangServerConfig(model_path=str(tmp_path), host="127.0.0.1", python=sys.executable,
                              launcher=(sys.executable, "-c", SERVER), log_path=str(tmp_path / "sglang0.log"),
                              device="cpu", max_total_tokens=4096, **kw)


def _first_pick_is(monkeypatch, port: int) -> list[int]:
    """The first port picked is ``port`` (taken by then), every later one a real free port."""
    picks: list[int] = []

    def pick(host: str, count: int) -> list[int]:
        ports = free_ports(host, count)
        if not picks:
            ports[0] = port
        picks.extend(ports)
        return ports

    monkeypatch.setattr(sglang_server, "free_ports", pick)
    return picks


def test_a_picked_port_taken_before_the_bind_is_picked_again(tmp_path, monkeypatch, taken_port):
    picks = _first_pick_is(monkeypatch, taken_port)
    engine = SGLangEngine.launch(_config(tmp_path), name="sglang0", startup_timeout_s=60)
    try:
        port = engine.server_config.port
        assert port != taken_port and port in picks
        assert engine.base_url == f"http://127.0.0.1:{port}"
        log = (tmp_path / "sglang0.log").read_text()
        assert log.count("address already in use") == 1 and f"serving on {port}" in log
        # restart() launches what was announced: the port it serves on, not the taken one.
        assert engine._relaunch["config"].port == port
        # The dead server's key file went with it; the live one's stays until its stop.
        assert len(list(tmp_path.glob("sglang0.secret*.yaml"))) == 1
    finally:
        engine.shutdown()


def test_a_port_the_user_set_is_theirs_and_its_failure_is_raised(tmp_path, taken_port):
    with pytest.raises(EngineError, match="address already in use"):
        SGLangEngine.launch(_config(tmp_path, port=taken_port), name="sglang0", startup_timeout_s=60)
    assert (tmp_path / "sglang0.log").read_text().count("address already in use") == 1


def test_any_other_failure_at_the_start_is_raised_without_a_second_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    with pytest.raises(EngineError, match="CUDA out of memory"):
        SGLangEngine.launch(_config(tmp_path), name="sglang0", startup_timeout_s=60)
    assert (tmp_path / "sglang0.log").read_text().count("CUDA out of memory") == 1


@pytest.mark.parametrize("line", [
    "OSError: [Errno 98] Address already in use",  # Python's (vLLM's API server)
    "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 37151): address already in use",
    "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5557')",
])
def test_each_servers_wording_of_a_taken_port_is_read_as_one(tmp_path, line):
    log = tmp_path / "server.log"
    log.write_text("an earlier life: Address already in use\n")
    offset = log.stat().st_size
    assert not lost_port_race(log, offset)
    with open(log, "a") as f:
        f.write(line + "\n")
    assert lost_port_race(log, offset)
