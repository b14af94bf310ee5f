"""The Python code tool's sandbox (issue 40, item 4): each bound, held by a call that needs it.

Every case fails if its bound is taken away: the loop runs past the CPU limit (wall deadline
longer), the fork loop would start all 200 children, the allocation would succeed, the
output would flow until the deadline, the SIGTERM-ignoring child would outlive the call, the
write would land on the host, the connection would open, the secret would be inherited.
Isolation beyond the resource limits needs namespaces (a user namespace for an ordinary
user); where the machine gives none, those cases skip saying so. The attacks of a hostile
policy, as root and as an ordinary user, are test_tool_sandbox_isolation.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from megatron_dapo.config.fields import ConfigError
from megatron_dapo.config.loader import load_config
from megatron_dapo.tools.sandbox import SandboxLimits, isolation_problem, run_python

PROBLEM = isolation_problem()
needs_namespaces = pytest.mark.skipif(PROBLEM is not None, reason=f"no namespaces here: {PROBLEM}")


def test_plain_code_runs_and_answers_its_output():
    r = run_python("print(6 * 7)")
    assert r.ok and r.text == "42\n"


def test_a_busy_loop_dies_of_the_cpu_limit_before_the_wall_deadline():
    # The wall deadline is far: only the CPU limit can end it (CPU time, so a loaded machine takes longer).
    r = run_python("while True: pass", SandboxLimits(cpu_seconds=1, timeout_s=60))
    assert r.status == "killed" and ("SIGKILL" in r.text or "SIGXCPU" in r.text), (r.status, r.seconds, r.text)


def test_a_child_that_ignores_sigterm_is_killed_at_the_deadline_with_all_it_started():
    marker = f"300.{uuid.uuid4().int % 10**9}"  # the detached child's argv (the program itself is not in argv)
    code = ("import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"if os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '{marker}'])\ntime.sleep(300)\n")
    r = run_python(code, SandboxLimits(timeout_s=2, cpu_seconds=5))
    assert r.status == "timeout" and r.seconds < 30, (r.status, r.seconds)
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                alive.append(pid)
        except OSError:
            pass
    if PROBLEM is not None:  # no PID namespace: a child that left the session survives
        pytest.skip(f"without a PID namespace a setsid() grandchild outlives the call ({PROBLEM})")
    assert alive == [], f"processes outlived the call: {alive}"


@needs_namespaces  # RLIMIT_NPROC counts the call's own user namespace (without one, all the user's processes)
def test_a_fork_loop_stops_at_the_process_limit():
    code = ("import os, time\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n"
            "    n += 1\nprint('forked', n)\n")
    r = run_python(code, SandboxLimits(processes=8, timeout_s=10))
    forked = int(r.text.split("forked")[1])
    assert forked < 8, r.text


def test_a_ten_gigabyte_allocation_fails_inside_the_call():
    r = run_python("x = bytearray(10 * 2**30)\nprint(len(x))", SandboxLimits(memory_bytes=512 * 2**20))
    assert r.status == "error" and "MemoryError" in r.text


def test_gigabytes_of_output_are_cut_at_the_cap_in_the_middle():
    r = run_python("import sys\nwhile True:\n    sys.stdout.write('ab' * 32768)", SandboxLimits(max_output_bytes=4096))
    assert r.status == "output_limit" and r.seconds < 30
    assert len(r.text.encode()) < 4096 + 100 and "bytes cut" in r.text


def test_bytes_that_are_not_utf8_reach_the_policy_replaced():
    r = run_python("import sys; sys.stdout.buffer.write(b'\\xff\\xfe ok')")
    assert r.ok and r.text == "\ufffd\ufffd ok"


def test_a_file_past_the_size_limit_is_refused():
    r = run_python("open('f', 'wb').write(b'x' * (8 * 2**20))", SandboxLimits(file_bytes=2**20))
    assert r.status == "error" and "File too large" in r.text


@needs_namespaces
def test_writes_outside_its_directory_never_reach_the_host():
    home = Path(tempfile.mkdtemp(dir=Path.home()))  # a root-owned directory outside /tmp, mode 755
    target = home / "outside.txt"
    shared = Path("/tmp") / f"mdapo-sandbox-{uuid.uuid4().hex}"  # world-writable on the host
    r = run_python(f"open({str(target)!r}, 'w').write('x')\n")
    assert r.status == "error" and ("Permission denied" in r.text or "No such file" in r.text) \
        and not target.exists(), r.text
    r = run_python(f"open({str(shared)!r}, 'w').write('x'); print('wrote')")
    try:
        assert r.ok and not shared.exists(), "a write to /tmp reached the host's /tmp"
    finally:
        shared.unlink(missing_ok=True)
        shutil.rmtree(home, ignore_errors=True)


@needs_namespaces
def test_no_network():
    r = run_python("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=2)\nprint('open')")
    assert r.status == "error" and "open" not in r.text.split("\n")[-1]
    assert "no network" in r.isolation


def test_no_inherited_secrets_or_descriptors(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_DAPO_TEST_SECRET", "hunter2")
    f = open(tmp_path / "open.txt", "w")  # noqa: SIM115  an inheritable descriptor of the trainer
    os.set_inheritable(f.fileno(), True)
    try:
        r = run_python("import os\nprint(sorted(os.environ))\nprint(sorted(os.listdir('/proc/self/fd')))")
    finally:
        f.close()
    env, fds = r.text.splitlines()
    assert "MEGATRON_DAPO_TEST_SECRET" not in env and "hunter2" not in r.text
    assert eval(fds) == ["0", "1", "2", "3"], fds  # stdin, stdout, stderr and listdir's own


def test_a_nul_byte_a_lone_surrogate_or_a_240_kb_program_is_the_programs_error_not_the_tools():
    # argv refused all three (ValueError, UnicodeEncodeError, E2BIG past 128 KB per argument): the program now
    # travels in a file, and what Python's compiler says of it is the answer (status error, never "failed").
    for code, said in (("print(1)\x00", "null bytes"), ("print('\udc80')", "Non-UTF-8")):
        r = run_python(code)
        assert r.status == "error" and said in r.text, (code, r)
    big = "x = 1\n" * 40_000 + "print('ran', x)\n"  # 240 KB
    r = run_python(big, SandboxLimits(timeout_s=30))
    assert r.ok and r.text == "ran 1\n", r


@pytest.mark.parametrize("override", ["tools.python.cpu_seconds=100000000000000000000", "tools.python.memory_mb=1000000000000000",
                                      "tools.python.processes=100000000000000000000", "tools.python.timeout_s=1e20",
                                      "tools.python.isolation=none"])
def test_limits_past_their_bounds_are_refused_at_config_time(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^command line: {key}=[^\n]*$"):
        load_config(None, [override])


def test_limits_only_says_so_in_every_call_record():
    r = run_python("print(1)", SandboxLimits(isolation="limits_only"))
    assert r.ok and r.isolation.startswith("limits_only"), r
