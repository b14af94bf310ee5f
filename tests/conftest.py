"""Shared pytest setup: GPU-marked tests skip with a reason where CUDA is missing, the slow
tiers are collected first, a tier whose engine is missing fails under CI=true (tests/tiers.py),
and the run ends with how many tests of each tier ran.

`make test` runs the suite on two xdist workers, a test file at a time (`--dist loadfile`,
so a module's server or cluster fixture is started once); a worker takes the next file when
it is done with one. The tiers whose files take minutes (real servers, trainer runs) come
first, the unit tier's hundred small files last, so neither worker is left with a long file
while the other has nothing to do.
"""

import os
from collections import Counter

import pytest
import torch
from proc_utils import worker_cpu_bind
from tiers import ci_message, in_ci

# Keep every test process to the two cores CI has; spawned ranks inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


# Each xdist worker's vLLM CPU servers on a core of their own (tests/proc_utils.py worker_cpu_bind);
# a binding the environment already has wins. SUITE_VLLM_BIND: what this set (None: nothing).
SUITE_VLLM_BIND = None
if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    SUITE_VLLM_BIND = worker_cpu_bind(os.environ.get("PYTEST_XDIST_WORKER"), sorted(os.sched_getaffinity(0)))
    if SUITE_VLLM_BIND is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = SUITE_VLLM_BIND


# Test directories, slowest files first (one core, 2026-11-26: sglang_cpu 12 min over 6 files,
# vllm_cpu 10 min over 5, e2e 18 min over 10, multirank 12 min over 26, unit 3 min over about
# 100). The slurm tier's file (3.5 min, mostly waiting on its daemons) goes early too: last, it
# was the one long file left while the other worker had nothing to do.
TIER_ORDER = ("sglang_cpu", "vllm_cpu", "slurm", "e2e", "multirank", "gpu", "unit")


def tier_of(nodeid: str) -> str:
    """The tier directory of a test id ("tests/e2e/test_x.py::t" -> "e2e"), "" outside one."""
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else ""


def _tier(item: pytest.Item) -> int:
    name = tier_of(item.nodeid)
    return TIER_ORDER.index(name) if name in TIER_ORDER else len(TIER_ORDER)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "engine_missing(reason): the tier's engine or cluster is missing "
                                       "(tests/tiers.py): skip, or fail under CI=true")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    mark = item.get_closest_marker("engine_missing")
    if mark is None:
        return
    if in_ci():
        pytest.fail(ci_message(mark.args[0]), pytrace=False)
    pytest.skip(mark.args[0])


def tier_counts(stats: dict[str, list]) -> dict[str, Counter]:
    """Per tier: how many tests passed, failed, were skipped or errored, from the terminal
    reporter's reports (on xdist's controller these are every worker's, so the counts are the run's)."""
    counts: dict[str, Counter] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            when = getattr(report, "when", None)
            # A test passes or fails in its call; skips and errors come from any phase.
            if not nodeid or (outcome in ("passed", "failed") and when != "call"):
                continue
            counts.setdefault(tier_of(nodeid) or "(other)", Counter())[outcome] += 1
    return counts


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """How many tests of each tier ran: a tier that shrank to skips shows here, not only in -ra."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports the run
        return
    counts = tier_counts(terminalreporter.stats)
    if not counts:
        return
    terminalreporter.section("tests per tier")
    for tier in sorted(counts, key=lambda t: TIER_ORDER.index(t) if t in TIER_ORDER else len(TIER_ORDER)):
        c = counts[tier]
        terminalreporter.write_line(f"{tier}: {c['passed'] + c['failed']} ran ({c['passed']} passed, "
                                    f"{c['failed']} failed), {c['skipped']} skipped, {c['error']} errors")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_tier)  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        # The marker, not item.keywords: keywords also hold every parent directory's name,
        # so a checkout in a directory called "gpu" skipped the whole suite.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
