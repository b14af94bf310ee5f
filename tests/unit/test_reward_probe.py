"""`config validate` runs a user's reward module only in a worker, bounded in time, quiet, and leaves
nothing behind (issue 42: a module that hung at import hung validate, its prints reached the console,
and a child it forked outlived the check)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_utils import alive

from megatron_dapo import cli
from megatron_dapo.rewards import pool

REPO = Path(__file__).resolve().parents[2]


def _module(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / f"{name}.py").write_text(text)


def test_a_module_that_hangs_at_import_is_one_line_within_the_bound(tmp_path, monkeypatch, capsys):
    _module(tmp_path, "rw_import_hang", "import time\ntime.sleep(600)\ndef f(s, gt, extra_info=None):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(pool, "PROBE_IMPORT_TIMEOUT_S", 3.0)
    start = time.monotonic()
    code = cli.run(["config", "validate", str(REPO / "examples/tiny_cpu.yaml"), "reward.reward_fn=rw_import_hang:f",
                    "reward.timeout_s=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert time.monotonic() - start < 30
    assert err.splitlines() == [err] and "importing it in a worker did not finish within 3 s" in err


def test_what_the_module_prints_or_starts_stays_out_of_the_check(tmp_path):
    pids = tmp_path / "pids"
    _module(tmp_path, "rw_noisy", f"""
import subprocess, sys
print("NOISE-AT-IMPORT", flush=True)
print("NOISE-ON-STDERR", file=sys.stderr, flush=True)
child = subprocess.Popen(["sleep", "600"])
open({str(pids)!r}, "a").write(f"{{child.pid}}\\n")
def f(solution_str, ground_truth, extra_info=None):
    print("NOISE-PER-CALL", flush=True)
    return 1.0
""")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "config", "validate",
                           str(REPO / "examples/tiny_cpu.yaml"), "reward.reward_fn=rw_noisy:f"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "NOISE" not in done.stdout + done.stderr
    children = [int(p) for p in pids.read_text().split()]
    assert children
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in children):
        time.sleep(0.2)
    assert [p for p in children if alive(p)] == []



@pytest.mark.parametrize(("text", "expected"), [
    ("raise SystemExit(3)\n", "importing 'rw_bad' raised SystemExit: 3; fix the module so that it imports cleanly"),
    ("import os\nos._exit(3)\n", "its worker exited with code 3 while importing it"),
    ("import no_such_dependency_77\n", "importing 'rw_bad' failed: No module named 'no_such_dependency_77'"),
    ("X = 1\n", "module 'rw_bad' has no attribute 'f'"),
])
def test_a_module_that_fails_at_import_is_one_line(tmp_path, monkeypatch, capsys, text, expected):
    _module(tmp_path, "rw_bad", text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    sys.modules.pop("rw_bad", None)
    code = cli.run(["config", "validate", str(REPO / "examples/tiny_cpu.yaml"), "reward.reward_fn=rw_bad:f"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [err] and expected in err, err
