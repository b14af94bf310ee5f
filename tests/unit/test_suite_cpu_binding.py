"""The suite's own placement of vLLM CPU servers: each xdist worker's on a core of its own
(tests/proc_utils.py `worker_cpu_bind`, docs/DESIGN.md "How the suite fits CI's budget")."""

import os

from proc_utils import worker_cpu_bind


def test_each_worker_gets_the_core_of_its_number_within_its_affinity():
    assert [worker_cpu_bind(f"gw{i}", [0, 1]) for i in range(3)] == ["0", "1", "0"]
    assert worker_cpu_bind("gw1", [4, 6]) == "6"  # the cores this process may use, not 0..n-1


def test_outside_xdist_nothing_is_bound():
    assert worker_cpu_bind(None, [0, 1]) is None
    assert worker_cpu_bind("master", [0, 1]) is None
    assert worker_cpu_bind("gw0", []) is None


def test_an_xdist_worker_runs_its_servers_on_its_own_core(request):
    """The root conftest applied it (unless the environment had a binding of its own)."""
    applied = request.config.pluginmanager.get_plugin(str(request.config.rootpath / "tests" / "conftest.py"))
    assert applied is not None, "the root conftest is not registered under its path"
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if applied.SUITE_VLLM_BIND is None:
        assert worker is None or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") is not None
        return
    assert worker_cpu_bind(worker, sorted(os.sched_getaffinity(0))) == applied.SUITE_VLLM_BIND
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == applied.SUITE_VLLM_BIND
