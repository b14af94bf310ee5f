"""A rollout fleet on a node of its own: slurm/dapo_tiny.sbatch with ENGINE_NODES=1 on two SLURM nodes.

The job holds both nodes of partition `split` (slurm_testbed.py); the script gives the actor's
rank the first and names the second in rollout.nodes, and the controller starts its vLLM server
there as an srun step of the job (rollout/fleet/nodes.py). The server's step is SIGKILLed after
the first step: the controller restarts it in place, a new step on the same node, and loads the
current weights into it by broadcast. Nothing of the fleet outlives the job.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_jobs import TINY_FAST, job_steps, read_log, submit, wait_for
from slurm_testbed import REPO, SlurmCluster
from tiers import unavailable, vllm_missing

pytestmark = pytest.mark.slurm


def _engine_steps(cluster: SlurmCluster, job: str) -> set[tuple[str, str, str]]:
    """(step id, name, node) of the job's running steps named engine*."""
    out = cluster.run("squeue", "-h", "-s", "-j", job, "-o", "%i %j %N", check=False).stdout
    return {tuple(line.split()[:3]) for line in out.splitlines() if len(line.split()) >= 3 and line.split()[1].startswith("engine")}  # type: ignore[misc]


def _fleet_processes(job: str) -> list[str]:
    """vLLM server processes of SLURM job `job` (their environment names it: srun steps of the job).
    Only this job's: under xdist another worker's vLLM tests may run servers at the same time."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], text=True, capture_output=True).stdout
    found = []
    for line in out.splitlines():
        if "vllm.entrypoints.openai.api_server" not in line:
            continue
        try:
            environ = Path(f"/proc/{line.split()[0]}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if f"SLURM_JOB_ID={job}".encode() in environ:
            found.append(line)
    return found


def test_fleet_on_a_node_of_its_own_survives_its_step_killed(slurm_cluster: SlurmCluster,
                                                            trainer_env: dict[str, str], tmp_path: Path) -> None:
    if slurm_cluster.engine_node is None:
        pytest.skip("this machine's hostname is localhost: the test cluster has no second node")
    if (missing := vllm_missing()) is not None:
        unavailable(missing)
    log, out_dir = tmp_path / "fleet.out", tmp_path / "run"
    # Steps take under a second here and the kill lands a step or two after the first; the
    # restarted server (a minute to start) must serve the ones after it.
    total = 8
    overrides = " ".join([
        # vLLM's CPU attention needs heads of >= 32 dimensions.
        *TINY_FAST, "model.scratch.hidden_size=128", "rollout.engine=vllm", "rollout.num_engines=1", "trainer.max_staleness=1",
        "algorithm.rollout_correction.rollout_is=token", f"trainer.total_training_steps={total}",
        "trainer.save_interval=100", f"trainer.output_dir={out_dir}",
    ])  # fmt: skip
    job = submit(slurm_cluster, "slurm/dapo_tiny.sbatch", log,
                  options=("--partition=split", "--nodes=2", "--ntasks-per-node=1"),
                  env={**trainer_env, "OVERRIDES": overrides, "ENGINE_NODES": "1", "GPUS_PER_NODE": "1",
                       "LOG_ROOT": str(tmp_path / "logs")})
    try:
        seen: set[tuple[str, str, str]] = set()

        def engine_up() -> bool:
            seen.update(_engine_steps(slurm_cluster, job))
            return bool(seen) and len(job_steps(out_dir)) >= 1

        wait_for(engine_up, 300, "the engine's step and the first training step", log)
        # The server runs as a step of the job on the node of its own (the job's last), not the actor's.
        match = re.search(r"^job \d+ attempt 0 on (\S+): 1 ranks, .*, engines on (\S+)$", read_log(log), re.M)
        assert match is not None, read_log(log)
        actor_node, engine_node = match.groups()
        assert {actor_node, engine_node} == {slurm_cluster.node, slurm_cluster.engine_node}
        assert {(name, node) for _, name, node in seen} == {("engine0", engine_node)}, seen
        assert _fleet_processes(job), "the job's vLLM server is not seen: the final check would pass vacuously"
        (first_step,) = {step for step, _, _ in seen}
        slurm_cluster.run("scancel", "--signal=KILL", first_step)

        def restarted() -> bool:
            seen.update(_engine_steps(slurm_cluster, job))
            return len({step for step, _, _ in seen}) >= 2

        wait_for(restarted, 240, "the engine's restart as a new step", log)
        state = slurm_cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 360)
        text = read_log(log)
        assert state == "COMPLETED", text
        assert {(name, node) for _, name, node in seen} == {("engine0", engine_node)}, seen
        assert job_steps(out_dir) == list(range(1, total + 1)), text
        metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert metrics[-1]["rollout/engine_restarts"] == 1, metrics[-1]
        assert all(m["async/staleness_max"] <= 1 for m in metrics), metrics
    finally:
        # A job that did not end (seen once under CI load: training stopped after step 3 with no
        # error printed, the process never exited) must not hold the nodes the later SLURM tests need.
        slurm_cluster.run("scancel", job, check=False)
    deadline = time.monotonic() + 30
    while _fleet_processes(job) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _fleet_processes(job), _fleet_processes(job)


# What each fake server records: its node, GPUs, CPUs and when it ran (it stays up a few seconds,
# as a server does, so two that start side by side overlap).
_GPU_SERVER = """\
import json, os, sys, time
start = time.time()
record = {k: os.environ.get(k) for k in ("SLURMD_NODENAME", "CUDA_VISIBLE_DEVICES", "SLURM_STEP_ID",
                                         "SLURM_CPUS_PER_TASK", "SLURM_MEM_PER_NODE")}
time.sleep(4)
record.update(start=start, end=time.time())
with open(sys.argv[1], "a") as out:
    out.write(json.dumps(record) + "\\n")
"""

# The trainer's side: the fleet's own launcher (rollout/fleet/nodes.py) and server environment.
_GPU_TRAINER = """\
import subprocess, sys
from megatron_dapo.rollout.fleet.nodes import fleet_sites
from megatron_dapo.rollout.server_process import server_environment
sites = fleet_sites(2, nodes=[sys.argv[1]], gpus_per_server=1)
print("launchers:", [" ".join(s.launcher) for s in sites], flush=True)
procs = [subprocess.Popen([*s.launcher, sys.executable, sys.argv[2], sys.argv[3]], env=server_environment())
         for s in sites]
print("exit codes:", [p.wait(timeout=120) for p in procs], flush=True)
"""


def test_gpu_servers_on_one_node_of_their_own_run_side_by_side_on_their_own_gpus(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """A GPU fleet's launcher against SLURM 22.05's own GPU accounting (the nodes' GRES are device
    files: no GPU runs here). A job of two nodes with 2 GPUs and 2 CPUs each, --mem asked; its
    step on the first node starts two one-GPU servers on the second as fleet_sites says. Both must
    run at once, each with a GPU of its own: with --overlap they would share GPUs, and with the
    job's CPUs, or its memory (srun reads the inherited SLURM_MEM_PER_NODE as --mem), held by the
    first step the second would wait for it forever."""
    if slurm_cluster.engine_node is None or slurm_cluster.engine_gpus < 2:
        pytest.skip("the test cluster has no second node with GPU GRES (hostname localhost, or no CAP_MKNOD)")
    server, trainer, records, log = (tmp_path / "server.py", tmp_path / "trainer.py", tmp_path / "servers.jsonl",
                                     tmp_path / "job.out")
    server.write_text(_GPU_SERVER)
    trainer.write_text(_GPU_TRAINER)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nset -e\n"
                      f"srun --nodes=1 --ntasks=1 --nodelist={slurm_cluster.node} --cpu-bind=none "
                      f"{sys.executable} {trainer} {slurm_cluster.engine_node} {server} {records}\n")
    job = submit(slurm_cluster, str(script), log, env={"PYTHONPATH": str(REPO)},
                 options=("--partition=split", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2",
                          "--gres=gpu:2", "--mem=1000"))
    state = slurm_cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 120)
    text = read_log(log)
    assert state == "COMPLETED", text
    assert "exit codes: [0, 0]" in text, text
    runs = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(runs) == 2, runs
    assert {r["SLURMD_NODENAME"] for r in runs} == {slurm_cluster.engine_node}, runs
    assert sorted(r["CUDA_VISIBLE_DEVICES"] for r in runs) == ["0", "1"], runs  # a GPU each, not the same one
    assert {r["SLURM_CPUS_PER_TASK"] for r in runs} == {"1"}, runs  # the node's 2 CPUs, one each
    first, second = sorted(runs, key=lambda r: r["start"])
    assert second["start"] < first["end"], f"the second server waited for the first: {runs}\n{text}"
