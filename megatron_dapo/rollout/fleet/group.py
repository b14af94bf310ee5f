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

__all__ = ["NCCL_TIMEOUT_HEADROOM_S", "abort_weight_group", "broadcast_bytes", "bucket_header", "collective_timeout_s",
           "destroy_weight_group", "flat_nbytes", "header_layout", "join_weight_group", "on_device", "side_stream",
           "split_flat"]

NCCL_TIMEOUT_HEADROOM_S = 120.0
"""How much longer than the controller's watch an NCCL collective may run before torch's watchdog
acts: the watcher (fleet/broadcast.py) aborts the group at its deadline (``timeout_s``), and the
jobs set ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, under which a collective past the group's timeout
kills the process; with equal deadlines the watchdog could win and FleetSyncError, the restart
budget and re-forming would be unreachable (DESIGN.md, "Rules where the device ... matters")."""


def collective_timeout_s(timeout_s: float, backend: str) -> float:
    """The group's collective deadline: ``timeout_s`` on gloo (its own deadline ends a hung
    broadcast, which the controller reports), ``timeout_s`` + NCCL_TIMEOUT_HEADROOM_S on NCCL."""
    return float(timeout_s) + (NCCL_TIMEOUT_HEADROOM_S if backend == "nccl" else 0.0)


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
        timeout_s: the rendezvous's deadline, and every collective's (plus NCCL_TIMEOUT_HEADROOM_S
            on NCCL: ``collective_timeout_s``).
        store_master: whether this process hosts the TCP store (default: rank 0). A pipeline
            stage's group (fleet/stages.py) has the stage's first rank as rank 0, the source
            of its broadcasts, while the controller, rank 1, hosts the store at its own address.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0 if store_master is None else store_master,
                         timeout=timedelta(seconds=timeout_s))
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters \
        else "pg_options"
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name,
        timeout=timedelta(seconds=collective_timeout_s(timeout_s, backend)), **{options: None},
    )  # fmt: skip
    # Its ranks, as SGLang's recipe records them: torch's destroy_process_group needs the entry
    # (destroy_weight_group); the group's own methods, which the broadcasts use, do not.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_group(group: dist.ProcessGroup, *, backend: str | None = None) -> None:
    """Leave a weight group for good: out of torch's registry of groups, its backend ended.

    NCCL groups are aborted (``abort_weight_group``), never shut down: since torch 2.5
    ``ProcessGroupNCCL::shutdown()``, which ``destroy_process_group`` calls, is graceful (it
    finalizes the communicator and waits for the kernels in flight), so leaving a group whose
    broadcast a dead or stalled server never joins would hang the caller; only ``abort()`` cancels
    them (torch 2.4's shutdown was itself an abort). Gloo groups are destroyed: ``group.shutdown()``
    alone frees nothing of a gloo group (torch 2.13's gloo backend has no shutdown of its own) and
    leaves it in torch's registry, so each group a vLLM worker left stayed alive, sockets and
    threads, for the process's life; a gloo group's threads finish its queued work first, which
    its own deadline bounds.

    Args:
        backend: "nccl" or "gloo"; default: the group's own (``dist.get_backend``).
    """
    if backend is None:
        try:
            backend = str(dist.get_backend(group))
        except Exception:  # not in torch's registry: ask the group itself
            backend = str(getattr(group, "_get_backend_name", lambda: "")())
    if backend == "nccl":
        abort_weight_group(group)
        return
    try:
        dist.destroy_process_group(group)
    except Exception:  # not registered as join_weight_group does, or broken: shut down at least
        with contextlib.suppress(Exception):
            group.shutdown()


def abort_weight_group(group: dist.ProcessGroup) -> None:
    """Abort a group's communicator (the NCCL kernels in flight are cancelled, nothing waits on them)
    and take the group out of torch's registry; returns at once whatever its members do.

    torch >= 2.5: c10d's ``_abort_process_group`` (``pg.abort()`` plus the registry's entries);
    before, or for a group torch's registry does not hold, the group's ``abort()`` (torch 2.4:
    ``shutdown()``, which aborted then) and the entries removed here.
    """
    from torch.distributed import distributed_c10d as c10d

    abort_registered = getattr(c10d, "_abort_process_group", None)
    if abort_registered is not None and group in c10d._world.pg_map:
        try:
            abort_registered(group)
            return
        except Exception:  # a partly registered group: abort it and clean up below
            pass
    end = getattr(group, "abort", None) or group.shutdown
    with contextlib.suppress(Exception):
        end()
    cleanup = getattr(c10d, "_cleanup_process_group_global_state", None)
    if cleanup is not None:
        with contextlib.suppress(Exception):
            cleanup(group)
        return
    world = c10d._world
    for registry in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                     world.pg_coalesce_state):
        registry.pop(group, None)


def side_stream(tensor: torch.Tensor, streams: dict[torch.device, torch.cuda.Stream]) -> torch.cuda.Stream | None:
    """The weight sync's own CUDA stream on `tensor`'s GPU (made once, kept in `streams`), after the
    calling thread's current stream: call it on the thread that wrote `tensor`, before handing the
    broadcast to a helper thread. None for a CPU tensor.

    ``work.wait()`` of an NCCL collective makes the *current* stream wait for the collective; on a
    helper thread that is the device's default stream, where the trainer computes, so a broadcast
    that never ends (a dead server mid-sync) would stall every later kernel of the trainer's rank.
    On this stream only the sync waits, and the abort (``abort_weight_group``) ends the wait.
    """
    if tensor.device.type != "cuda":
        return None
    stream = streams.get(tensor.device)
    if stream is None:
        stream = streams[tensor.device] = torch.cuda.Stream(tensor.device)
    stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the bytes are written before they go
    return stream


def broadcast_bytes(group: dist.ProcessGroup, flat: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
    """Broadcast `flat` from the group's rank 0 (or receive it) on the calling thread, the NCCL
    collective ordered after `stream` (``side_stream``) and waited on there, not on the default stream."""
    with on_device(flat), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        group.broadcast([flat], dist.BroadcastOptions()).wait()


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
