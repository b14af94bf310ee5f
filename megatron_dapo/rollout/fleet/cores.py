"""Which CPU cores, and how many threads, each server of a CPU fleet gets.

A fleet's servers run beside the trainer on the same cores. Left alone, every server process
sizes torch's OpenMP pool to all of them: two servers and the trainer then ran six OpenMP
threads on two cores, and every parallel region's barrier waited for a descheduled thread (a
2-server SGLang fleet on the 2-core CI machine: 94 s of generation per step of the tiny run
against 2.5 s with one thread per server; DESIGN.md, "A CPU fleet's servers get cores of their
own"). Each server is given its own slice of this process's cores; the engines' launchers turn
the slice into their own settings (rollout/sglang/server.py, rollout/vllm/server.py). Servers on
nodes of their own (rollout/fleet/nodes.py) share that node's cores instead.

When the loop overlaps generation with the update (max_staleness > 0) the trainer computes while
the servers generate, so beside them it keeps cores of its own too (``split_beside_trainer``): the
trainer and each server get an equal slice, and the trainer's ranks on the node size torch's pool
to theirs (``trainer_threads``). With one server on two cores the server took both and the
actor's update ran on the same two (DESIGN.md, "A CPU fleet's servers get cores of their own").
In the synchronous loop generation and update take turns, so each gets every core.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["core_share", "server_cores", "split_beside_trainer", "thread_count", "trainer_threads"]


def core_share(index: int, num_engines: int, cores: Sequence[int] | None = None) -> list[int]:
    """The cores of fleet server `index` of the `num_engines` that share `cores` (default: this
    process's, for servers beside the trainer): an equal slice, in order; with more servers than
    cores one core each, taken round the cores."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    share = max(1, len(cores) // num_engines)
    start = (index * share) % len(cores)
    return cores[start:start + share]


def thread_count(cores: list[int]) -> int:
    """OpenMP threads for a server on `cores`: one per core, fewer if this process's
    OMP_NUM_THREADS asks for fewer (a sweep that runs several trainers at once sets it)."""
    inherited = os.environ.get("OMP_NUM_THREADS", "")
    return min(len(cores), int(inherited)) if inherited.isdigit() and int(inherited) > 0 else len(cores)


def split_beside_trainer(num_engines: int, overlapped: bool,
                         cores: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """(the servers' cores, the trainer's cores) for `num_engines` servers beside the trainer on
    `cores` (default: this process's). Overlapped loop: the trainer and each server an equal slice
    of them, the trainer the first cores and what does not divide; synchronous loop, or fewer
    cores than servers + 1: every core to both."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if not overlapped or len(cores) < num_engines + 1:
        return cores, cores
    share = len(cores) // (num_engines + 1)
    keep = len(cores) - num_engines * share
    return cores[keep:], cores[:keep]


def trainer_threads(num_engines: int, overlapped: bool, local_ranks: int,
                    cores: Sequence[int] | None = None) -> int | None:
    """torch threads for each of the trainer's `local_ranks` ranks on a node with a fleet of
    `num_engines` servers beside it, or None when the trainer keeps every core (synchronous loop,
    too few cores)."""
    servers, trainer = split_beside_trainer(num_engines, overlapped, cores)
    if servers == trainer:
        return None
    return max(1, len(trainer) // max(1, local_ranks))


def server_cores(index: int, num_engines: int, node_cores: Sequence[int] | None = None, *,
                 overlapped: bool = False) -> tuple[list[int], int]:
    """(cores, OpenMP threads) of fleet server `index` of the `num_engines` sharing its cores.

    Beside the trainer (node_cores None) they share this process's cores, less the trainer's own
    in an overlapped loop (split_beside_trainer), and the trainer's OMP_NUM_THREADS caps the
    threads (thread_count); on a node of the fleet's own (rollout/fleet/nodes.py) they share that
    node's cores whole, one thread per core.
    """
    if node_cores is not None:
        cores = core_share(index, num_engines, node_cores)
        return cores, len(cores)
    cores = core_share(index, num_engines, split_beside_trainer(num_engines, overlapped)[0])
    return cores, thread_count(cores)
