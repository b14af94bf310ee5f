"""Helper processes die with a SIGKILLed parent (megatron_dapo/lifetime.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_utils import alive

from megatron_dapo.lifetime import GroupReaper

REPO = Path(__file__).resolve().parents[2]

# The parent imports megatron_dapo as the trainer does; the helper processes are the ones a
# run starts: megatron-core's spawn Manager (its checkpoint writer's result queue) and the
# reward pool's forkserver workers.
PARENT = """
import multiprocessing as mp, os, sys, time
import megatron_dapo
from megatron_dapo.rewards.pool import RewardPool

if __name__ == "__main__":
    manager = mp.get_context("spawn").Manager()
    pool = RewardPool("reward_fns_for_tests:half", num_workers=2, timeout_s=30)
    pids = [manager._process.pid] + [w.process.pid for w in pool._workers]
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(600)
"""



@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_helpers_die_within_10s_of_a_kill_9_of_their_parent(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "unit"), str(REPO)]),
           "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    try:
        line = parent.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3, line
        assert all(alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)  # the parent only, as the OOM killer does
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.2)
        assert [p for p in pids if alive(p)] == []
    finally:
        # What survived a failing test: its own session, so only this test's processes.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)


# A "trainer" that starts servers the way engines do (ServerProcess: a session of their own): s0
# plain, s1 with a child that ignores SIGTERM; s2 it stops itself (its leader ends on SIGTERM, a
# child that ignores it must not outlive the stop); s3, whose leader ignores SIGTERM, it is still
# stopping when it dies (torchrun's SIGTERM once another rank failed, seen with an SGLang server
# stopped after a failed broadcast): the reaper must not have been released yet.
SERVER_PARENT = """
import os, sys, threading, time
from megatron_dapo.rollout.server_process import ServerProcess

log = sys.argv[1]
stubborn = "trap '' TERM; sleep 600 & wait"
servers = [ServerProcess(["/bin/sh", "-c", "sleep 600 & sleep 600"], name="s0", log_path=log),
           ServerProcess(["/bin/sh", "-c", stubborn], name="s1", log_path=log),
           ServerProcess(["/bin/sh", "-c", "(trap '' TERM; exec sleep 600) & sleep 600"], name="s2", log_path=log),
           ServerProcess(["/bin/sh", "-c", stubborn], name="s3", log_path=log)]

def members(pgid):  # (processes of the group, of them ignoring SIGTERM)
    found, ignoring = 0, 0
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{d}/stat").read().rsplit(") ", 1)[1].split()[2] != str(pgid):
                continue
            ign = next(l for l in open(f"/proc/{d}/status") if l.startswith("SigIgn:")).split()[1]
        except (OSError, StopIteration):
            continue
        found += 1
        ignoring += bool(int(ign, 16) & (1 << (15 - 1)))
    return found, ignoring

# Each shell has started its children and set its traps (a SIGTERM before the trap would end s3).
want = [(2, 0), (2, 2), (3, 1), (2, 2)]  # at least (a shell may exec its last command)
deadline = time.monotonic() + 60
while any(m[0] < w[0] or m[1] < w[1] for m, w in zip((members(s.pid) for s in servers), want)):
    assert time.monotonic() < deadline, [members(s.pid) for s in servers]
    time.sleep(0.01)
servers[2].stop(timeout_s=5)
sent = threading.Event()
real_killpg = os.killpg
def killpg(pgid, sig):
    real_killpg(pgid, sig)
    if pgid == servers[3].pid and sig == 15:
        sent.set()
os.killpg = killpg
threading.Thread(target=servers[3].stop, kwargs={"timeout_s": 600}, daemon=True).start()
assert sent.wait(60)  # s3 has its SIGTERM and ignores it
print(" ".join(str(s.pid) for s in servers), servers[2]._reaper.pid, flush=True)
time.sleep(600)
"""


def _group_alive(pgid: int) -> bool:
    def in_group(pid: str) -> bool:
        try:  # a process may exit between the listing and the read
            return alive(int(pid)) and open(f"/proc/{pid}/stat").read().split(") ")[1].split()[2] == str(pgid)
        except OSError:
            return False

    return any(in_group(d) for d in os.listdir("/proc") if d.isdigit())


@pytest.mark.parametrize("how", ["kill -9 of the trainer", "kill -9 of the trainer's process group"])
def test_engine_servers_die_within_10s_of_a_kill_9_of_their_trainer(tmp_path: Path, how: str) -> None:
    """Issue 42: a vLLM server outlived its kill -9'd trainer (own session, parent 1). Each server
    now has a reaper (lifetime.GroupReaper) that ends its process group once the trainer is gone,
    SIGTERM then SIGKILL; a server the trainer stopped itself has released its reaper."""
    script = tmp_path / "trainer.py"
    script.write_text(SERVER_PARENT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    trainer = subprocess.Popen([sys.executable, str(script), str(tmp_path / "servers.log")], stdout=subprocess.PIPE,
                               text=True, env=env, start_new_session=True)
    try:
        fields = trainer.stdout.readline().split()
        servers, released_reaper = [int(p) for p in fields[:4]], fields[4]
        assert released_reaper == "None"
        assert _group_alive(servers[0]) and _group_alive(servers[1])
        # The stopped server's group got its SIGKILL; its last members may take a moment to be
        # reaped on a loaded machine (seen 2026-12-02 beside three training runs).
        deadline = time.monotonic() + 10
        while _group_alive(servers[2]):
            assert time.monotonic() < deadline, f"the stopped server's group {servers[2]} is still alive after 10 s"
            time.sleep(0.05)
        assert _group_alive(servers[3])
        if how == "kill -9 of the trainer":
            trainer.send_signal(signal.SIGKILL)
        else:
            os.killpg(trainer.pid, signal.SIGKILL)  # torchrun's way: the servers' sessions are not in it
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_group_alive(p) for p in servers):
            time.sleep(0.2)
        assert [p for p in servers if _group_alive(p)] == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trainer.pid, signal.SIGKILL)
        for pgid in servers if "servers" in locals() else []:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


def test_a_reaper_released_from_many_threads_at_once_closes_its_pipe_once() -> None:
    """Every request thread of an engine whose server died calls check_alive -> release at
    the same moment (CI 2026-11-27: EBADF from the second close, a trainer crash instead of
    an engine restart). Closing an fd number twice can also close another object's fd."""
    import threading

    def release(reaper: GroupReaper, start: threading.Barrier, errors: list[BaseException]) -> None:
        start.wait()
        try:
            reaper.release()
        except BaseException as error:
            errors.append(error)

    for _ in range(30):
        sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
        try:
            reaper = GroupReaper(sleeper.pid)
            start = threading.Barrier(8)
            errors: list[BaseException] = []
            threads = [threading.Thread(target=release, args=(reaper, start, errors)) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not errors, errors
            assert reaper.pid is None
        finally:
            sleeper.kill()
            sleeper.wait()


# A module that daemonises at import (fork, setsid, fork): its grandchild is in no group of ours.
DAEMON_AT_IMPORT = """
import os, time
ready_r, ready_w = os.pipe()
child = os.fork()
if child == 0:
    os.setsid()
    if os.fork() == 0:
        with open(os.environ["DAEMON_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        os.write(ready_w, b"1")
        time.sleep(3600)
    os._exit(0)
os.waitpid(child, 0)
os.read(ready_r, 1)  # the import ends once the daemon runs and has written its pid (else validate could end it first)
os.close(ready_r)
os.close(ready_w)


def f(*args, **kwargs):
    return 1.0 if len(args) > 1 else "1"
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux-only")
@pytest.mark.parametrize("overrides", [
    ["reward.reward_fn=daemon_mod:f", "reward.num_workers=0"],  # imported by validate itself
    ["reward.reward_fn=daemon_mod:f", "reward.num_workers=1"],  # by the probe's worker
    ["tools.enable=true", "tools.tools=[calculator=daemon_mod:f]", "algorithm.filter_groups.mode=rounds",
     "data.embedded.big_mul=0.4", "data.embedded.mul=0.0", "data.embedded.two_step=0.0"],  # a tool worker
], ids=["reward-in-process", "reward-probe-worker", "custom-tool-worker"])
def test_what_a_module_starts_at_import_in_a_session_of_its_own_ends_with_config_validate(
        tmp_path: Path, overrides: list[str]) -> None:
    (tmp_path / "daemon_mod.py").write_text(DAEMON_AT_IMPORT)
    (tmp_path / "c.yaml").write_text("trainer: {seed: 1}\n")
    pids_file = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "HOME": str(tmp_path),
           "DAEMON_PIDS": str(pids_file), "OMP_NUM_THREADS": "1"}
    env.pop("MEGATRON_DAPO_CACHE", None)
    try:
        # Without the guard this times out: the survivor holds validate's stdout and stderr open.
        proc = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "config", "validate", "c.yaml", *overrides],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        pids = [int(p) for p in pids_file.read_text().split()]
        assert pids, "the module was not imported"
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in pids if alive(p)] == []
    finally:
        for p in (pids_file.read_text().split() if pids_file.exists() else []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p), signal.SIGKILL)


TORCHRUN_RANK = """
import os, sys, time
from megatron_dapo import train
train.train = lambda *a: time.sleep(3600)  # the rank as main() runs it, without the run
open(sys.argv[1] + f".{os.environ['RANK']}", "w").write(str(os.getpid()))
train.main(["c.yaml"])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_ranks_die_within_5s_of_a_kill_9_of_the_torchrun_agent(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(TORCHRUN_RANK)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-port", "0", str(script), str(tmp_path / "pid")], cwd=tmp_path, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2:
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
            pids = [int(p.read_text()) for p in tmp_path.glob("pid.*") if p.read_text()]
        assert all(alive(p) for p in pids)
        agent.send_signal(signal.SIGKILL)  # the agent only: the ranks are in its session, not signalled
        agent.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in pids if alive(p)] == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
