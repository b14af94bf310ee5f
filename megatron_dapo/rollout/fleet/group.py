"""The weight broadcast's process group: one recipe for the controller (rank 0) and for the servers.

SGLang's ``init_custom_process_group`` (the recipe verl, slime and OpenRLHF share) rendezvouses
on ``tcp://master:port``, wraps the store in ``PrefixStore(group_name)`` and builds the group
with torch's ``_new_process_group_helper``, outside any default group. Every member must build
its side the same way for the stores' keys to meet, so the controller repeats those steps as
rank 0 (it hosts the TCP store), and the vLLM workers' transfer engine (rollout/vllm/transfer.py)
joins with the same function: vLLM's own gloo helper (``stateless_init_torch_distributed_process_group``)
rendezvouses differently and would not meet SGLang's side or ours. The helper is private torch
API, which is why its options argument is looked up by name (``backend_options`` in torch >= 2.6,
``pg_options`` before). torch only: vLLM's and SGLang's processes import this.
"""

from __future__ import annotations

import contextlib
import inspect
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["bucket_header", "destroy_weight_group", "flat_nbytes", "header_layout", "join_weight_group", "on_device",
           "split_flat"]


def on_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Make `tensor`'s GPU the calling thread's current device (nothing for a CPU tensor).

    An NCCL collective runs, and a lazily created communicator binds, on the calling thread's
    current device, which is per thread and 0 in a fresh one. The broadcasts run on helper
    threads (the sync's pool, a stage's sender thread), so a rank whose GPU is not 0 (a stage's
    first rank at local rank 4) would broadcast from the wrong device without this.
    """
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()


def join_weight_group(*, master_address: str, master_port: int, world_size: int, rank: int, group_name: str,
                      backend: str = "gloo", timeout_s: float = 600.0, store_master: bool | None = None
                      ) -> dist.ProcessGroup:
    """Form (rank 0) or join (the others) the broadcast group; returns once every rank joined.

    Args:
        master_address: the controller's address every member can reach.
        master_port: the store's port (rank 0 listens on it).
        world_size: 1 + the TP workers of every server.
        rank: this process's rank (0 = the controller, the source of every broadcast).
        group_name: the group's name (the store's key prefix); fresh for each forming.
        backend: "nccl" (GPUs) or "gloo" (CPU tensors).
        timeout_s: the rendezvous's and every collective's deadline.
        store_master: whether this process hosts the TCP store (default: rank 0). A pipeline
            stage's group (fleet/stages.py) has the stage's first rank as rank 0, the source
            of its broadcasts, while the controller, rank 1, hosts the store at its own address.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0 if store_master is None else store_master,
                         timeout=timeout)
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters \
        else "pg_options"
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name,
        timeout=timeout, **{options: None},
    )  # fmt: skip
    # Its ranks, as SGLang's recipe records them: torch's destroy_process_group needs the entry
    # (destroy_weight_group); the group's own methods, which the broadcasts use, do not.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_group(group: dist.ProcessGroup) -> None:
    """Leave a weight group for good: out of torch's registry of groups, its backend shut down.

    ``group.shutdown()`` alone frees an NCCL communicator but nothing of a gloo group (torch 2.13's
    gloo backend has no shutdown of its own) and leaves the group in torch's registry, so each
    group a vLLM worker left stayed alive, sockets and threads, for the process's life. Only for a
    group no collective is running on: a gloo group's threads finish its queued work first.
    """
    try:
        dist.destroy_process_group(group)
    except Exception:  # not registered as join_weight_group does, or broken: shut down at least
        with contextlib.suppress(Exception):
            group.shutdown()


def split_flat(flat: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """The tensors of a received flat bucket (broadcast.flat_bytes' inverse): views, in order.

    Each tensor's bytes start where the previous one's end; the sender orders wider dtypes
    first, so every view is aligned for its dtype.
    """
    tensors, offset = [], 0
    for dtype, shape in zip(dtypes, shapes):
        nbytes = flat_nbytes([dtype], [shape])
        tensors.append(flat[offset:offset + nbytes].view(dtype).view(shape))
        offset += nbytes
    if offset != flat.numel():
        raise ValueError(f"a flat bucket of {flat.numel()} bytes holds {offset} bytes of the tensors named")
    return tensors


def flat_nbytes(dtypes: list[torch.dtype], shapes: list[list[int]]) -> int:
    """Bytes of the tensors' flat bucket (what a receiver allocates before the broadcast)."""
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=d).element_size() for d, shape in zip(dtypes, shapes))


def bucket_header(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int]]]:
    """What a receiver needs to allocate a flat bucket: (name, dtype name, shape) per tensor, in order."""
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in bucket]


def header_layout(header: list[tuple[str, str, list[int]]]) -> tuple[list[str], list[torch.dtype], list[list[int]]]:
    """bucket_header's inverse: the names, dtypes and shapes (split_flat's and flat_nbytes' arguments)."""
    return [n for n, _, _ in header], [getattr(torch, d) for _, d, _ in header], [list(s) for _, _, s in header]
