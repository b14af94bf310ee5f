"""Where each server of a fleet runs: beside the trainer, or on nodes of its own as `srun` steps.

Past a few nodes the rollout engines run on nodes the actor does not use (issue 41).
``rollout.nodes`` names them (slurm/dapo.sbatch sets it from ENGINE_NODES=K: the allocation's
last K nodes, the actor's ranks on the others), and the controller starts server i on
``nodes[i % len(nodes)]`` as a step of the trainer's own SLURM job::

    srun --jobid=$SLURM_JOB_ID --nodes=1 --ntasks=1 --nodelist=NODE --overlap \
         --kill-on-bad-exit=1 --cpu-bind=none --job-name=NAME  <the server's command>

Checked on a two-node SLURM 22.05 cluster (tests/slurm/test_slurm_fleet.py; both slurmds on one
machine, so "another node" is SLURM's, not another kernel's):

- a step started from a task of another step runs on the node named: the flags win over the
  outer step's SLURM_* variables the trainer inherits;
- srun exports its environment to the task (``--export=ALL``, the default), so the variables
  a launcher sets for its server (keys, thread binding) reach it on the other node;
- srun forwards SIGTERM to the task, and a SIGKILLed srun still ends its step (slurmstepd loses
  its client and kills the task). The reaper that ends a server's process group when the
  trainer dies (lifetime.py) therefore ends a remote server too, trainer kill -9 included,
  and a restart in place (the controller's budget) starts a fresh step on the same node;
- the server's output comes back through srun into its log file beside the trainer.

What a node of its own changes for the server. It binds the node's address as SLURM knows it
(``scontrol show node``'s NodeAddr), which the controller also calls; its ports are ones free
on the controller's node at launch (a node of the job runs nothing else of ours; a port taken
there makes the server exit at start, and the start fails naming its log). On CPU the node's
cores are the servers' alone: the servers placed on one node share its cores
(SLURM_JOB_CPUS_PER_NODE), one OpenMP thread per core, whatever the trainer's OMP_NUM_THREADS.
The weight broadcast's master is the controller's address on the route to the first engine
node. Files the server reads (the HF export, the SGLang key file beside its log) must be on a
filesystem the engine nodes share with the trainer's, as checkpoints already must.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_dapo.errors import UserError

__all__ = ["FleetSite", "check_nodes", "fleet_sites", "job_cpus_per_node", "visible_gpus", "weight_master_address"]


@dataclass(frozen=True, slots=True)
class FleetSite:
    """Where one server of the fleet runs and how it is started."""

    host: str
    """The address the server binds and the controller calls."""
    launcher: tuple[str, ...] = ()
    """argv put before the server's command (an `srun` step); empty: a child of the trainer."""
    node: str | None = None
    """The SLURM node of its own; None: beside the trainer."""
    slot: int = 0
    """Its index among the servers on its node (beside the trainer: in the fleet)."""
    peers: int = 1
    """Servers on its node (beside the trainer: the fleet's size); they share its cores."""
    cores: tuple[int, ...] | None = None
    """A node of its own: that node's cores; None: the trainer's (rollout/fleet/cores.py)."""
    base_gpu_id: int = 0
    """A GPU server: its first GPU among those it sees (SGLang's --base-gpu-id). Beside the trainer
    the GPUs after the trainer's ranks'; an srun step sees only its own, so 0."""


def fleet_sites(num_engines: int, *, nodes: Sequence[str] = (), host: str | None = None, gpus_per_server: int = 0,
                trainer_gpus: int = 0, node_gpus: int | None = None) -> list[FleetSite]:
    """Where each of the fleet's `num_engines` servers runs.

    Args:
        num_engines: rollout.num_engines.
        nodes: rollout.nodes; empty = every server beside the trainer.
        host: rollout.host, the address servers beside the trainer bind (default loopback).
        gpus_per_server: 0 = CPU servers; else each server's GPUs (its TP size).
        trainer_gpus: GPU servers beside the trainer: the GPUs the trainer's ranks on this node
            use (its first ones); the servers take the next ones.
        node_gpus: GPU servers beside the trainer: the GPUs this node shows (None = no check).

    Raises:
        UserError: nodes are named but this process is not a task of a SLURM job, srun is missing,
            or a node is not the job's or runs the trainer's ranks; GPU servers beside the trainer
            do not fit in the node's GPUs.
    """
    if not nodes:
        if gpus_per_server and node_gpus is not None and trainer_gpus + num_engines * gpus_per_server > node_gpus:
            raise UserError(
                f"rollout.num_engines={num_engines} GPU servers of rollout.tensor_model_parallel_size={gpus_per_server} "
                f"GPU(s) beside the trainer's {trainer_gpus} need {trainer_gpus + num_engines * gpus_per_server} GPUs, "
                f"this node shows {node_gpus}: lower rollout.num_engines or the trainer's GPUs per node, or put the "
                "servers on nodes of their own (rollout.nodes; slurm/dapo.sbatch ENGINE_NODES=K)")
        return [FleetSite(host=host or "127.0.0.1", slot=i, peers=num_engines,
                          base_gpu_id=trainer_gpus + i * gpus_per_server) for i in range(num_engines)]
    check_nodes(nodes)
    cpus = job_cpus_per_node()
    job = os.environ["SLURM_JOB_ID"]
    addresses = {node: node_addr(node) for node in nodes}
    sites = []
    for i in range(num_engines):
        node = nodes[i % len(nodes)]
        peers = len(range(i % len(nodes), num_engines, len(nodes)))
        if gpus_per_server:
            resources = _gpu_step(gpus_per_server, node, cpus.get(node), peers)
        else:  # CPU servers share nothing exclusive (their cores are split by their thread binding)
            resources = ("--overlap",)
        launcher = ("srun", f"--jobid={job}", "--nodes=1", "--ntasks=1", f"--nodelist={node}", *resources,
                    "--kill-on-bad-exit=1", "--cpu-bind=none", f"--job-name=engine{i}")
        sites.append(FleetSite(host=addresses[node], launcher=launcher, node=node, slot=i // len(nodes), peers=peers,
                               cores=tuple(range(cpus[node])) if node in cpus else None))
    return sites


def visible_gpus(site: FleetSite, gpus: int) -> dict[str, str]:
    """The environment that gives a GPU server beside the trainer its GPUs, for an engine that takes
    the first ones it sees (vLLM has no --base-gpu-id): CUDA_VISIBLE_DEVICES = its `gpus` GPUs from
    ``site.base_gpu_id`` on, counted in this process's CUDA_VISIBLE_DEVICES when that is set (the
    server's values are the ones the node names them by). Nothing for a server on a node of its own:
    its srun step's --gres gives it its GPUs and SLURM sets the variable (DESIGN.md "GPU fleets").
    """
    if site.launcher:
        return {}
    shown = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    first = site.base_gpu_id
    ids = shown[first:first + gpus] if shown else [str(i) for i in range(first, first + gpus)]
    if len(ids) < gpus:  # fleet_sites checked torch's count; a CUDA_VISIBLE_DEVICES listing fewer is the user's
        raise UserError(f"a GPU server beside the trainer needs GPUs {first}..{first + gpus - 1} of those this "
                        f"process sees, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} lists "
                        f"{len(shown)}: list every GPU of the node, or put the servers on nodes of their own")
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}


def _gpu_step(gpus: int, node: str, node_cpus: int | None, peers: int) -> tuple[str, ...]:
    """The srun options of a GPU server's step: its own GPUs and its share of the node's CPUs and memory.

    Not `--overlap`: since SLURM 22.05 an overlapping step shares GRES too, and a step without
    `--gres` gets every GPU of the job on its node, so every server would see the same GPUs.
    `--exact` with an explicit share of CPUs and memory lets the node's `peers` steps start side
    by side; without them the first step takes the job's whole node (CPUs; memory too, as srun
    reads the job's SLURM_MEM_PER_NODE as the step's --mem) and the others wait for it, which for
    a server is forever. SLURM sets each step's CUDA_VISIBLE_DEVICES to its own GPUs (DESIGN.md,
    "GPU fleets"); the SLURM_* variables srun would read as requests are not passed on
    (server_process.server_environment).

    Raises:
        UserError: the job's CPUs or GPUs on the node cannot hold its servers side by side.
    """
    if node_cpus is not None and node_cpus < peers:
        raise UserError(f"rollout.nodes: node {node} holds {node_cpus} CPU(s) of this job, fewer than the {peers} "
                        "servers placed there need (one each at least, or their srun steps wait for each other "
                        "forever): give the job more CPUs per node (sbatch --cpus-per-task or --exclusive) or "
                        "lower rollout.num_engines")
    per_node = _job_gpus_per_node()
    if per_node is not None and peers * gpus > per_node:
        raise UserError(f"rollout.nodes: node {node} gets {peers} servers of rollout.tensor_model_parallel_size="
                        f"{gpus} GPU(s), {peers * gpus} GPUs, but the job holds {per_node} per node "
                        "(SLURM_GPUS_PER_NODE): lower rollout.num_engines or add engine nodes (ENGINE_NODES)")
    options = ["--exact", f"--gres=gpu:{gpus}"]
    if node_cpus:
        options.append(f"--cpus-per-task={node_cpus // peers}")
    mem = _job_mem_per_node_mb()
    # --mem=0: the step may use the job's memory on the node without holding it from the others.
    options.append(f"--mem={max(1, mem // peers)}M" if mem else "--mem=0")
    return tuple(options)


def _job_gpus_per_node() -> int | None:
    """GPUs the job asked for on each node (SLURM_GPUS_PER_NODE: "8" or "h100:8"), else None."""
    match = re.fullmatch(r"(?:[\w-]+:)?(\d+)", os.environ.get("SLURM_GPUS_PER_NODE", "").strip())
    return int(match.group(1)) if match else None


def _job_mem_per_node_mb() -> int | None:
    """The job's memory on each node in MiB (SLURM_MEM_PER_NODE, set when the job asked for --mem), else None."""
    value = os.environ.get("SLURM_MEM_PER_NODE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def weight_master_address(host: str | None, engine_host: str | None = None) -> str:
    """The controller's address in the weight broadcast group. Servers on nodes of their own (one of
    them at `engine_host`): this node's interface that routes there (server_process.node_address,
    MEGATRON_DAPO_ENGINE_HOST overrides); servers beside the trainer: rollout.host, else loopback."""
    if engine_host:
        from megatron_dapo.rollout.server_process import node_address

        return node_address(engine_host)
    return host or "127.0.0.1"


def node_addr(node: str) -> str:
    """The address SLURM reaches `node` at (NodeAddr; the name itself when scontrol does not say)."""
    try:
        out = subprocess.run(["scontrol", "-o", "show", "node", node], text=True, capture_output=True, timeout=30,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return node
    match = re.search(r"\bNodeAddr=(\S+)", out)
    return match.group(1) if match else node


def job_cpus_per_node() -> dict[str, int]:
    """CPUs the job holds on each of its nodes: SLURM_JOB_CPUS_PER_NODE ("16,8(x2)") against
    the job's node list, in order; {} when either is missing or they do not match."""
    counts: list[int] = []
    for part in os.environ.get("SLURM_JOB_CPUS_PER_NODE", "").split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return {}
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    hosts = _hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))
    return dict(zip(hosts, counts)) if len(hosts) == len(counts) else {}


def _hostnames(nodelist: str) -> list[str]:
    if not nodelist:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], text=True, capture_output=True, timeout=30,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return out.split()


def check_nodes(nodes: Sequence[str]) -> None:
    """rollout.nodes inside the SLURM job whose nodes they are (fleet_sites; `config validate`)."""
    named = f"rollout.nodes={','.join(n[:80] for n in nodes[:8])}{',...' if len(nodes) > 8 else ''}"
    if "SLURM_JOB_ID" not in os.environ:
        raise UserError(f"{named} starts the fleet's servers as srun steps of this SLURM job, but this process is "
                        "not in one (no SLURM_JOB_ID): submit slurm/dapo.sbatch with ENGINE_NODES=K, or leave "
                        "rollout.nodes empty to run the servers beside the trainer")
    if shutil.which("srun") is None:
        raise UserError(f"{named}: srun is not on this node's PATH, so the servers cannot be started there; "
                        "run the trainer where SLURM's client commands are installed")
    job_nodes = _hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))
    foreign = [n for n in nodes if job_nodes and n not in job_nodes]
    if foreign:
        raise UserError(f"{named}: {', '.join(foreign)} not in this job's nodes ({','.join(job_nodes)}); "
                        "name nodes of the allocation (slurm/dapo.sbatch ENGINE_NODES=K picks its last K)")
    trainer_nodes = _hostnames(os.environ.get("SLURM_STEP_NODELIST", ""))
    shared = [n for n in nodes if n in trainer_nodes]
    if shared:
        raise UserError(f"{named}: {', '.join(shared)} also runs the trainer's ranks (this step's nodes: "
                        f"{','.join(trainer_nodes)}); engines on nodes of their own need nodes the actor does not "
                        "use: start the ranks on the other nodes (slurm/dapo.sbatch ENGINE_NODES=K does)")
