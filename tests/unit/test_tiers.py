"""Tiers cannot vanish (tests/tiers.py, tests/conftest.py): a tier whose engine is missing skips
locally and fails under CI=true with one line per test, and the run prints per-tier counts, also
aggregated over two xdist workers. Run on a copy of the suite's conftest over a tree of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

MISSING = """
import pytest
from tiers import requires

pytestmark = requires("SGLang is not installed (make install-sglang-cpu)")


def test_one():
    assert True


def test_two():
    assert True
"""

PRESENT = """
from tiers import requires

pytestmark = requires(None)


def test_{name}():
    assert {outcome}
"""


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("suite")
    tests = root / "tests"
    for tier in ("sglang_cpu", "unit", "e2e"):
        (tests / tier).mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", tests / "conftest.py")
    shutil.copy(TESTS / "tiers.py", tests / "tiers.py")
    shutil.copy(TESTS / "proc_utils.py", tests / "proc_utils.py")  # the conftest's imports
    (tests / "sglang_cpu" / "test_engine.py").write_text(MISSING)
    for i in range(3):
        (tests / "unit" / f"test_u{i}.py").write_text(PRESENT.format(name=f"u{i}", outcome="True"))
    (tests / "e2e" / "test_e.py").write_text(PRESENT.format(name="e", outcome="False"))
    return root


def run(tree: Path, ci: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "--rootdir", str(tree), *args, "tests"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)


def test_under_ci_a_missing_engine_fails_each_test_with_one_line(tree):
    proc = run(tree, "true")
    assert proc.returncode == 1
    line = ("CI=true and SGLang is not installed (make install-sglang-cpu): this tier must run in CI; "
            "install what it needs, or unset CI to skip it")
    errors = [x for x in proc.stdout.splitlines() if x.startswith("ERROR tests/sglang_cpu/")]
    assert len(errors) == 2 and all(x.endswith(f"Failed: {line}") for x in errors), proc.stdout[-3000:]
    assert "sglang_cpu: 0 ran (0 passed, 0 failed), 0 skipped, 2 errors" in proc.stdout


def test_without_ci_it_skips_and_the_counts_are_the_whole_runs_over_two_workers(tree):
    proc = run(tree, None, "-n", "2", "--dist", "loadfile")
    assert proc.returncode == 1, proc.stdout[-3000:]  # the e2e test fails, nothing else
    assert "unit: 3 ran (3 passed, 0 failed), 0 skipped, 0 errors" in proc.stdout, proc.stdout[-3000:]
    assert "sglang_cpu: 0 ran (0 passed, 0 failed), 2 skipped, 0 errors" in proc.stdout
    assert "e2e: 1 ran (0 passed, 1 failed), 0 skipped, 0 errors" in proc.stdout
    assert proc.stdout.count("tests per tier") == 1
