"""Where the launcher put this process, read before any process group exists, and free ports.

torchrun's and SLURM's environment variables (rank, world size, ranks per node, the rendezvous
address) and the TCP ports a process picks for a store or a server it starts. Imports nothing
heavy (no torch, no megatron-core), so the CLI and the rollout servers' launchers can use it
before either is loaded. parallel.py builds the process groups from what this module reads.
"""

from __future__ import annotations

import os
import re
import socket

__all__ = ["first_slurm_host", "free_port", "free_ports", "launched", "launcher_local_world_size",
           "launcher_ranks"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (a store or a server binds it shortly after)."""
    return free_ports(host, 1)[0]


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct TCP ports free on `host` right now: held open together while they are
    picked, since a port just closed is the kernel's next answer (a fleet's groups, one store each)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks = [socket.socket(family, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def launcher_local_world_size() -> int:
    """Processes of the job per node, as the launcher says: torchrun's LOCAL_WORLD_SIZE, else SLURM's
    SLURM_NTASKS_PER_NODE (set with --ntasks-per-node, as the sbatch scripts do; "8(x16)" when SLURM
    compresses equal counts: the first node's); 1 otherwise. Colocated engines need it exact and
    check it themselves (rollout/placement.py ranks_per_node_from_env)."""
    value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1")
    count = re.match(r"\s*(\d+)", value)
    return max(int(count.group(1)), 1) if count else 1


def launcher_ranks() -> tuple[int, int, int]:
    """Where the launcher put this process, before any process group exists.

    Under SLURM without MASTER_ADDR/MASTER_PORT it also exports them (first node of the
    job, a port derived from the job id), as init_distributed needs them.

    Returns:
        (rank, world_size, local_rank) from torchrun, SLURM, or (0, 1, 0).
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in env:
                raise ValueError(
                    f"RANK/WORLD_SIZE are set but {key} is not; launch with torchrun or set {key}"
                )
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        if "MASTER_ADDR" not in env:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise ValueError(
                    "SLURM_PROCID is set but neither MASTER_ADDR nor SLURM_JOB_NODELIST is; "
                    "export MASTER_ADDR in the sbatch script"
                )
            env["MASTER_ADDR"] = first_slurm_host(nodelist)
        if "MASTER_PORT" not in env:
            env["MASTER_PORT"] = str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0"))
    return 0, 1, 0


def launched() -> bool:
    """Whether torchrun or SLURM started this process (else it is a one-process world)."""
    return ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or (
        "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ
    )


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist: "gpu[03-05,09],cpu1" -> "gpu03".

    Args:
        nodelist: SLURM_JOB_NODELIST.

    Returns:
        The host name of the first node.
    """
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}; export MASTER_ADDR instead")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]
