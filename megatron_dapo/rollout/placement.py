"""Where colocated SGLang engines run: one engine per rollout-TP consecutive GPUs of every node.

Pure arithmetic over global ranks plus the launcher's ranks-per-node and one collective
check of the node layout; colocated.py launches the engines, syncs their weights and
hands their memory over using this placement. Bad job shapes are UserErrors (one line,
exit code 2) raised before any server starts.

Placement
    Node n holds global ranks ``[n*G, (n+1)*G)`` with local ranks ``0..G-1`` (G = ranks per
    node: LOCAL_WORLD_SIZE under torchrun, SLURM_NTASKS_PER_NODE under srun; one rank per
    GPU, local rank = GPU index). With T = ``rollout.tensor_model_parallel_size``, the node's
    GPUs are cut into G/T engines of T consecutive local ranks, so engine ``e = rank // T``
    holds global ranks ``[e*T, (e+1)*T)``, its engine TP rank ``r = rank % T`` runs on the GPU
    of that training rank. The first rank of the group, the *engine leader*, launches the
    server with ``--base-gpu-id`` = its local rank, ``--tp-size T`` and ``--host`` = the node's
    address. T must divide G: an engine never spans nodes, because CUDA IPC handles only
    open on the node (here: the very GPU) that made them. Flagship: 16 nodes x 8 H-class
    GPUs at T=8 give 16 engines, leaders at ranks 0, 8, ..., 120.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_dapo.errors import UserError

__all__ = [
    "EnginePlacement",
    "EngineSlot",
    "check_node_layout",
    "plan_placement",
    "ranks_per_node_from_env",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSlot:
    """Where one engine runs."""

    index: int
    """Global engine index (engines of node 0 first)."""
    name: str
    """Engine name in logs and metrics: ``sglang<index>``."""
    node: int
    """Node index (global rank // ranks per node)."""
    leader_rank: int
    """Global rank that launches the server and posts its weights."""
    base_gpu_id: int
    """--base-gpu-id: the leader's local rank."""
    tp_size: int
    """--tp-size: GPUs of the engine."""
    ranks: tuple[int, ...]
    """Global ranks on the engine's GPUs, in engine TP-rank order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EnginePlacement:
    """One engine per ``engine_tp`` consecutive local ranks of every node (see the module docstring)."""

    num_nodes: int
    """Nodes of the job."""
    gpus_per_node: int
    """Ranks (= GPUs) per node."""
    engine_tp: int
    """GPUs per engine (rollout.tensor_model_parallel_size)."""

    @property
    def world_size(self) -> int:
        """Ranks of the job."""
        return self.num_nodes * self.gpus_per_node

    @property
    def engines_per_node(self) -> int:
        """Engines on each node."""
        return self.gpus_per_node // self.engine_tp

    @property
    def num_engines(self) -> int:
        """Engines of the job."""
        return self.num_nodes * self.engines_per_node

    def engine_of(self, rank: int) -> int:
        """Index of the engine that uses this global rank's GPU."""
        return rank // self.engine_tp

    def tp_rank_of(self, rank: int) -> int:
        """Engine TP rank whose worker runs on this global rank's GPU."""
        return rank % self.engine_tp

    def is_leader(self, rank: int) -> bool:
        """Whether this global rank launches and feeds an engine."""
        return rank % self.engine_tp == 0

    def slot(self, index: int) -> EngineSlot:
        """Where engine ``index`` runs."""
        assert 0 <= index < self.num_engines, (index, self.num_engines)
        leader = index * self.engine_tp
        return EngineSlot(
            index=index, name=f"sglang{index}", node=leader // self.gpus_per_node, leader_rank=leader,
            base_gpu_id=leader % self.gpus_per_node, tp_size=self.engine_tp,
            ranks=tuple(range(leader, leader + self.engine_tp)),
        )  # fmt: skip

    def group_ranks(self) -> list[list[int]]:
        """Global ranks of every engine's group, by engine (the per-engine process groups)."""
        return [list(self.slot(e).ranks) for e in range(self.num_engines)]


def plan_placement(*, world_size: int, gpus_per_node: int, engine_tp: int) -> EnginePlacement:
    """Check the job's shape against the rollout TP size and place the engines.

    Args:
        world_size: ranks of the job (one per GPU).
        gpus_per_node: ranks per node.
        engine_tp: rollout.tensor_model_parallel_size.

    Returns:
        The placement.

    Raises:
        UserError: one line naming the values and the fix (the CLI prints it, exit code 2).
    """
    if gpus_per_node < 1 or world_size % gpus_per_node:
        raise UserError(
            f"world size {world_size} is not a multiple of {gpus_per_node} ranks per node; colocated SGLang "
            "engines need the same number of ranks (one per GPU) on every node"
        )
    if engine_tp < 1 or gpus_per_node % engine_tp:
        divisors = ", ".join(str(d) for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0)
        raise UserError(
            f"rollout.tensor_model_parallel_size={engine_tp} does not divide the {gpus_per_node} GPUs per node; "
            f"set it to one of {divisors} (a colocated engine cannot span nodes: CUDA IPC is node-local)"
        )
    return EnginePlacement(num_nodes=world_size // gpus_per_node, gpus_per_node=gpus_per_node, engine_tp=engine_tp)


def ranks_per_node_from_env(world_size: int) -> int:
    """Ranks per node as the launcher reports it.

    Args:
        world_size: ranks of the job (a one-process job needs no launcher variable).

    Returns:
        LOCAL_WORLD_SIZE (torchrun), else SLURM_NTASKS_PER_NODE (srun --ntasks-per-node).
    """
    env = os.environ
    if "LOCAL_WORLD_SIZE" in env:
        return int(env["LOCAL_WORLD_SIZE"])
    value = env.get("SLURM_NTASKS_PER_NODE")
    if value is not None:
        # "8", or "8(x16)" when SLURM compresses equal counts; "8,4" = uneven nodes.
        match = re.fullmatch(r"(\d+)(?:\(x\d+\))?", value.strip())
        if match is None:
            raise UserError(
                f"SLURM_NTASKS_PER_NODE={value!r}: colocated SGLang engines need the same number of ranks on "
                "every node; launch with srun --ntasks-per-node=<GPUs per node>"
            )
        return int(match.group(1))
    if world_size == 1:
        return 1
    raise UserError(
        "neither LOCAL_WORLD_SIZE (torchrun) nor SLURM_NTASKS_PER_NODE (srun --ntasks-per-node) is set, so the "
        "ranks per node are unknown; launch with torchrun or srun --ntasks-per-node=<GPUs per node>"
    )


def check_node_layout(placement: EnginePlacement, *, rank: int, local_rank: int) -> None:
    """Collective: verify that node n holds global ranks [n*G, (n+1)*G) in local-rank order.

    Engines are placed by global rank, which is right only if the launcher put ranks on
    nodes in contiguous blocks (torchrun, srun's default block distribution) and the ranks
    of a block share a host. Raises the same UserError on every rank otherwise.
    """
    seen: list[Any] = [None] * placement.world_size
    dist.all_gather_object(seen, (socket.gethostname(), local_rank))
    g = placement.gpus_per_node
    for r, (host, local) in enumerate(seen):
        node_host = seen[r - r % g][0]
        if local != r % g or host != node_host:
            raise UserError(
                f"rank {r} runs on {host} as local rank {local}, but colocated engines expect node {r // g} "
                f"({node_host}) to hold ranks {r - r % g}..{r - r % g + g - 1} in order; launch ranks in node "
                "blocks (torchrun, or srun --distribution=block)"
            )
