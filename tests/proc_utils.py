"""Process facts read from /proc (tests only)."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def cpu_flags() -> set[str]:
    """This CPU's flags from /proc/cpuinfo; MEGATRON_DAPO_CPUINFO names another cpuinfo (the install
    script's rule), for a Python running under an emulated CPU (docs/benchmarks.md: the AVX2 checks)."""
    import os
    from pathlib import Path

    for line in Path(os.environ.get("MEGATRON_DAPO_CPUINFO", "/proc/cpuinfo")).read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def processes_with(marker: str) -> int:
    """How many processes have `marker` in their whole command line."""
    import subprocess

    out = subprocess.run(["ps", "-ww", "-eo", "args"], text=True, capture_output=True).stdout
    return sum(marker in line for line in out.splitlines())


def shut_down_mid_relaunch(relaunch, shutdown, marker: str, started=lambda: True) -> tuple[bool, list, int]:
    """Run `relaunch()` on a thread; once its fresh server (the one process whose command line holds
    `marker`) runs and `started()`, call `shutdown()`. Returns (whether the relaunch was still
    running 15 s later, what it raised, how many `marker` processes were left 10 s after that)."""
    import threading
    import time

    failure: list[BaseException] = []

    def run() -> None:
        try:
            relaunch()
        except BaseException as err:
            failure.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not started() or processes_with(marker) != 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the relaunch did not start a fresh server: {failure}")
        time.sleep(0.1)
    time.sleep(1.0)  # its health checks are refused meanwhile
    shutdown()
    thread.join(timeout=15)
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return thread.is_alive(), failure, processes_with(marker)


def worker_cpu_bind(worker: str | None, cpus: list[int]) -> str | None:
    """The core an xdist worker's vLLM CPU servers bind their worker threads to: worker gwN's is
    the N-th core this process may use (None outside xdist).

    vLLM 0.32's default binding (VLLM_CPU_OMP_THREADS_BIND=auto, utils/ompmultiprocessing.py)
    is the same for every server, core 0 of a 2-core machine, so the two workers' servers ran on
    one core while the other held only their trainers (2026-12-03, AMD Zen 4: the vLLM engine and
    MoE files side by side took 137 s, 109 s with a core each). A fleet's servers still get their
    own slices where the test asks for the product's placement (it drops this variable)."""
    if not worker or not worker.startswith("gw") or not worker[2:].isdigit() or not cpus:
        return None
    return str(cpus[int(worker[2:]) % len(cpus)])
