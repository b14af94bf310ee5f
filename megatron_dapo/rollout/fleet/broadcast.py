"""Weights to a fleet of rollout servers by broadcast: one process group, the controller its rank 0.

Engines on devices or nodes of their own share no memory with the trainer, so step 7 cannot
hand them tensors (CUDA IPC, shared-memory files). Instead the controller and every TP worker
of every server form one process group (SGLang's ``/init_weights_update_group``: NCCL on GPUs,
gloo on CPU; world = 1 + the servers' TP sizes), and each bucket of full HF tensors travels
once, as one broadcast of its bytes from rank 0:

1. every server is asked, in a thread of its own, to receive the bucket
   (``/update_weights_from_distributed``, names, dtypes and shapes, ``load_format:
   flattened_bucket``): it allocates the tensors, concatenates their bytes in request order and
   joins the broadcast;
2. the controller broadcasts the same concatenation (``flat_bytes``);
3. every server loads the tensors and answers; ``finish_weight_update`` then sets the version
   on each (and flushes or, paused in place, keeps its cache: rollout/sglang/weights.py).

Read in sglang 0.5.12, 0.5.18 and 0.5.23 (``model_runner_components/weight_updater.py``, 0.5.12's
``model_runner.py``): for ``flattened_bucket`` the server allocates the request's tensors in
order, each ``flatten().view(torch.uint8)``, and receives them as one buffer broadcast from src 0;
0.5.23 also needs each tensor at a multiple of its element size (wider dtypes go first here) and
the begin/end weight-update session the engine opens. The server's side of the group has no
deadline of its own (torch's 30 min default): a trainer that dies takes its servers with it
(lifetime.py), so only the controller's side needs one.

With pipeline stages (fleet/stages.py) each further stage gets a group of its own, its first
rank the source (rank 0) and the controller rank 1 (``prepare_stages``, ``receive_stage``);
they are formed with the controller's, after it, in stage order.

Deadlines, never a hang. The group is formed with ``timeout_s`` (rendezvous and every
collective); each server's request has the same HTTP deadline; the controller waits for the
answers at most that long. A server that died or did not answer ends the sync with one
EngineError naming it (``FleetSyncError.engines``); the group is then broken for everyone and
is formed again, with every member, before the next sync.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_dapo.faults import fault_point
from megatron_dapo.rollout.flat_bucket import FLATTENED_BUCKET
from megatron_dapo.rollout.fleet.blame import FleetSyncError, blame
from megatron_dapo.rollout.fleet.group import (
    broadcast_bytes,
    destroy_weight_group,
    flat_nbytes,
    header_layout,
    join_weight_group,
    side_stream,
    split_flat,
)
from megatron_dapo.rollout.weight_sync import with_lm_head_copy

__all__ = ["DaemonCalls", "FleetMember", "FleetSyncError", "StageGroup", "WeightBroadcast", "flat_bytes", "wire_order"]

logger = logging.getLogger(__name__)

class FleetMember(Protocol):
    """What a server of the fleet offers (SGLangEngine)."""

    name: str

    @property
    def tp_size(self) -> int: ...

    def init_weight_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int, group_name: str, backend: str = "nccl") -> None: ...

    def receive_distributed(self, bucket: Sequence[tuple[str, torch.Tensor]], *, group_name: str,
                            load_format: str | None = None, timeout_s: float | None = None) -> None: ...

    def finish_weight_update(self, version: int | None = None) -> None: ...

    def leave_weight_update_groups(self, group_names: Sequence[str]) -> None: ...

    def health(self) -> bool: ...


class DaemonCalls:
    """Each server call on a daemon thread of its own.

    A ThreadPoolExecutor's workers are joined when the interpreter exits, so a controller that
    failed mid-sync (its exception already printed) waited there for a call its servers could
    answer only once it joined their group: servers waiting in the rendezvous until their deadline,
    the controller waiting for them, its servers' reaper waiting for its death (seen: a vLLM fleet's
    trainer alive 10 minutes after its traceback). A daemon thread never holds the exit.
    """

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # the caller reads it from the future
                future.set_exception(err)

        threading.Thread(target=run, name=f"fleet-{getattr(fn, '__name__', 'call')}", daemon=True).start()
        return future


_Joins = tuple[str, dict[Future, FleetMember], dict[int, Any]]
"""One group's joins (WeightBroadcast._joined): its name, each server's join request, each server's process."""


def wire_order(bucket: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The bucket in the order its bytes travel: wider dtypes first, so every tensor starts at a multiple
    of its element size, which sglang 0.5.23's receiver requires ("Unaligned received tensor";
    0.5.18 does not check)."""
    return sorted(bucket, key=lambda item: -item[1].element_size())


@dataclass(frozen=True, slots=True)
class StageGroup:
    """The group a pipeline stage's first rank joins as rank 0, the source of its broadcasts
    (fleet/stages.py); the controller (rank 1) hosts its store."""

    stage: int
    name: str
    master_address: str
    master_port: int
    world_size: int
    backend: str
    timeout_s: float


def flat_bytes(bucket: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The bucket's tensors as one uint8 buffer, each ``flatten().view(uint8)`` in order (what the
    server allocates for ``flattened_bucket``)."""
    return torch.cat([t.detach().contiguous().flatten().view(torch.uint8) for _, t in bucket])


class WeightBroadcast:
    """Step 7 for a fleet: each bucket broadcast once to every server (module docstring)."""

    def __init__(self, engines: Sequence[FleetMember], *, master_address: str, backend: str = "gloo",
                 timeout_s: float = 600.0, device: torch.device | str | None = None) -> None:
        """Args:
            engines: the fleet's servers, in rank order (server i's TP rank 0 is rank 1 + the
                TP sizes before it).
            master_address: the controller's address the servers can reach.
            backend: "gloo" (CPU tensors) or "nccl" (the controller's GPU).
            timeout_s: the deadline of the group's rendezvous, of each collective and of each
                server's request.
            device: where the controller's side of each broadcast lives: its own GPU for "nccl"
                (default: the current CUDA device), the CPU for "gloo".
        """
        if not engines:
            raise ValueError("a fleet needs at least one engine")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"WeightBroadcast backend={backend!r} must be gloo (CPU) or nccl (GPUs)")
        self.engines = list(engines)
        self.master_address = master_address
        self.backend = backend
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        """The controller's buffers: NCCL broadcasts GPU memory, gloo here CPU memory."""
        self.timeout_s = float(timeout_s)
        self._group: dist.ProcessGroup | None = None
        self._group_name = ""
        self._members: tuple[int, ...] = ()
        self._base_name = ""
        self._base_port = 0
        self._stage_groups: dict[int, tuple[dist.ProcessGroup, str]] = {}
        self._planned: list[StageGroup] = []
        self._joined: list[_Joins] = []
        """The groups formed (or being formed) since the last drop: each name, its servers' join
        requests, and each server's process then (by id(server): a restart replaces it in place)."""
        self._stale: list[_Joins] = []
        """The groups dropped since: their servers leave them before the next group forms (``_leave_stale``)."""
        self._pool = DaemonCalls()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        """The sync's own CUDA stream per device (group.side_stream): NCCL broadcasts wait there."""
        self.exit_grace_s = 10.0
        """How long a server whose worker died may take to exit before another member is blamed."""
        self.seconds_broadcast = 0.0
        """Seconds spent in broadcasts (the controller's side) since construction."""
        self.bytes_broadcast = 0
        """Bytes broadcast since construction (each reaches every server)."""

    @property
    def world_size(self) -> int:
        return 1 + sum(e.tp_size for e in self.engines)

    def engine_replaced(self, index: int, engine: FleetMember) -> None:
        """A restarted server is a new process: the group is formed again (with it) before the next bucket."""
        self.engines[index] = engine
        self._drop_group()

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one bucket to every server.

        Raises:
            FleetSyncError: a server died or did not answer within timeout_s (it is named).
        """
        if not bucket:
            return
        if any(getattr(e, "lm_head_copy", False) for e in self.engines):  # a tied Qwen3-MoE on SGLang
            bucket = list(with_lm_head_copy(list(bucket)))
        bucket = wire_order(bucket)
        self._ensure_group()

        def concatenate() -> torch.Tensor:  # a restart's reload sends host copies: to the group's device
            return flat_bytes(bucket).to(self.device)

        self._carry(self._group, self._group_name, bucket, concatenate, "the broadcast")  # type: ignore[arg-type]

    def receive_stage(self, stage: int, header: Sequence[tuple[str, str, list[int]]]) -> list[tuple[str, torch.Tensor]]:
        """Receive, with every server, one bucket that pipeline stage ``stage``'s first rank broadcasts
        in its group (fleet/stages.py); returns the bucket (the copy a restarted server is loaded from).

        Args:
            header: the bucket's (name, dtype name, shape) in the order of its flat bytes.

        Raises:
            FleetSyncError: a server died or did not answer, or the stage's broadcast did not come
                within timeout_s.
        """
        self._ensure_group()
        group, name = self._stage_groups[stage]
        names, dtypes, shapes = header_layout(header)
        meta = [(n, torch.empty(shape, dtype=dtype, device="meta")) for n, dtype, shape in zip(names, dtypes, shapes)]
        flat = self._carry(group, name, meta,
                           lambda: torch.empty(flat_nbytes(dtypes, shapes), dtype=torch.uint8, device=self.device),
                           f"pipeline stage {stage}'s broadcast", source=f"pipeline stage {stage}'s first rank")
        return list(zip(names, split_flat(flat, dtypes, shapes), strict=True))

    def _carry(self, group: dist.ProcessGroup, name: str, bucket: Sequence[tuple[str, torch.Tensor]],
               buffer: Callable[[], torch.Tensor], what: str, source: str | None = None) -> torch.Tensor:
        """One bucket through ``group``: every server is asked to receive it (names, dtypes, shapes
        of ``bucket``), then the broadcast of ``buffer()`` (the bytes, or room for them when another
        rank sends: ``source`` names that rank), then every server's answer. Returns the buffer."""
        futures = {self._pool.submit(e.receive_distributed, bucket, group_name=name,
                                     load_format=FLATTENED_BUCKET, timeout_s=self.timeout_s): e
                   for e in self.engines}
        # The servers allocate the bucket while the controller makes its buffer (the requests go
        # first: the copy of the whole bucket no longer delays their broadcast).
        flat = buffer()
        fault_point("fleet_metadata", 0)
        start = time.perf_counter()
        stream = None
        if self.backend == "nccl":
            stream = side_stream(flat, self._streams)  # on this thread, which wrote the bytes
            self._watched_broadcast(group, flat, stream, what, futures, source)
        else:
            try:
                work = group.broadcast([flat], dist.BroadcastOptions())
            except Exception as err:  # the group broke before this bucket
                self._fail(what, err, futures, source)
            # A trainer killed, or failing, mid-broadcast (tests); outside the handler below, so an
            # injected failure stays the controller's own, not a server's.
            fault_point("broadcast", 0)
            try:
                work.wait()
            except Exception as err:  # a member died or hung: gloo's own deadline (timeout_s) ended it
                self._fail(what, err, futures, source)
        self.seconds_broadcast += time.perf_counter() - start
        self.bytes_broadcast += flat.numel()
        self._answers(what, futures, source=source)
        if stream is not None:  # every server has the bucket: the broadcast ended; a received one is read next
            torch.cuda.current_stream(flat.device).wait_stream(stream)
        return flat

    def _watched_broadcast(self, group: dist.ProcessGroup, flat: torch.Tensor, stream: torch.cuda.Stream | None,
                           what: str, futures: dict, source: str | None) -> None:
        """The NCCL broadcast, watched (``_watch``): it ends the sync when a server's request fails or
        timeout_s passes. NCCL's communicator is made at the first broadcast, which blocks until
        every rank joins, with no deadline of its own; a server that failed before joining (an
        update refused, a worker gone) would hold it for ever. The collective is ordered and waited
        on the sync's own stream (group.side_stream), so a broadcast that never ends stalls no kernel
        of the trainer; dropping the group aborts the communicator (group.abort_weight_group), which
        cancels the broadcast in flight (a shutdown would wait for it)."""

        def send() -> None:
            broadcast_bytes(group, flat, stream)

        fault_point("broadcast", 0)  # the controller killed, or failing, as the broadcast starts (tests)
        _, ended, err = self._watch(send, "fleet-broadcast", futures)
        if ended == "server":
            self._fail(what, None, futures, source)
        if ended == "late":
            self._fail(what, TimeoutError(f"the broadcast did not end within {self.timeout_s:g} s"), futures, source)
        if err is not None:
            self._fail(what, err, futures, source)

    def _watch(self, fn: Callable[[], Any], name: str, futures: dict) -> tuple[Any, str, BaseException | None]:
        """Run `fn` on a daemon thread while watching the servers' requests, at most timeout_s.

        Returns:
            (fn's result, how the watch ended: "done", "server" (a request failed first) or "late",
            fn's error).
        """
        holder: dict[str, Any] = {}

        def run() -> None:
            try:
                holder["result"] = fn()
            except BaseException as err:  # the caller reports it with the servers' side
                holder["error"] = err

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout_s
        while thread.is_alive():
            thread.join(timeout=0.2)
            if any(f.done() and f.exception() is not None for f in futures):
                return None, "server", None
            if time.monotonic() > deadline:
                return None, "late", None
        return holder.get("result"), "done", holder.get("error")

    def finish_weight_update(self, version: int | None = None) -> None:
        """Every server ends the update and takes ``version``."""
        futures = {self._pool.submit(e.finish_weight_update, version): e for e in self.engines}
        fault_point("fleet_finish", 0)
        self._answers("finish_weight_update", futures, drop_group=False)

    def reload(self, index: int, buckets: Sequence[Sequence[tuple[str, torch.Tensor]]], version: int | None) -> None:
        """Load the current weights into server ``index`` alone (restarted while the others kept theirs).

        A group of the controller and that server only, dropped afterwards; the fleet's group is
        formed again (with the new process) before the next sync, as engine_replaced says.

        Raises:
            FleetSyncError: the server died or did not answer within timeout_s.
        """
        solo = WeightBroadcast([self.engines[index]], master_address=self.master_address, backend=self.backend,
                               timeout_s=self.timeout_s, device=self.device)
        loaded = False
        try:
            for bucket in buckets:
                solo.update_weights(bucket)
            solo.finish_weight_update(version)
            loaded = True
        finally:
            solo.close(leave=loaded)  # loaded: the server holds no group but the fleet's next one

    def close(self, *, leave: bool = False) -> None:
        """Drop the controller's side of the groups; ``leave``: the servers leave theirs now too (not
        at shutdown, where the servers are stopped next)."""
        self._drop_group()
        if leave:
            self._leave_stale()

    # ------------------------------------------------------------------ the group

    def prepare_stages(self, stages: int) -> list[StageGroup] | None:
        """The groups pipeline stages 1..stages-1 join as rank 0 before the next bucket (fleet/stages.py),
        or None while the groups formed before still hold every server.

        The controller is rank 1 of each (it hosts the group's store at ``master_address`` and
        receives every bucket too: the copy a restarted server is loaded from), the servers'
        workers ranks 2.. . ``_ensure_group`` forms them, after stage 0's, in stage order.
        """
        members = tuple(id(e) for e in self.engines)
        if self._group is not None and members == self._members and len(self._stage_groups) == stages - 1:
            return None
        self._drop_group()
        self._leave_stale()  # before the ports are taken and the stage sources start to join
        from megatron_dapo.launcher import free_ports

        base = f"megatron-dapo-weights-{uuid.uuid4().hex[:8]}"
        self._base_port, *ports = free_ports(self.master_address, stages)
        self._planned = [StageGroup(stage=s, name=f"{base}-stage{s}", master_address=self.master_address,
                                    master_port=port, world_size=self.world_size + 1, backend=self.backend,
                                    timeout_s=self.timeout_s) for s, port in zip(range(1, stages), ports)]
        self._base_name = base
        return list(self._planned)

    def form(self) -> None:
        """Form the fleet's groups now (every planned stage group too) unless they hold every server.

        Raises:
            FleetSyncError: a server died or did not join within timeout_s.
        """
        self._ensure_group()

    def _ensure_group(self) -> None:
        members = tuple(id(e) for e in self.engines)
        if self._group is not None and members == self._members:
            return
        if self._group is not None or not self._base_name:  # no stage groups planned for these members
            from megatron_dapo.launcher import free_port

            self._drop_group()
            self._leave_stale()  # before the port is taken: a slow leave must not let another process have it
            self._base_name = f"megatron-dapo-weights-{uuid.uuid4().hex[:8]}"
            self._base_port = free_port(self.master_address)
        name = self._base_name
        try:
            self._group = self._form(name, self._base_port, rank=0, world_size=self.world_size)
            self._group_name, self._members = name, members
            for plan in self._planned:
                self._stage_groups[plan.stage] = (self._form(plan.name, plan.master_port, rank=1,
                                                             world_size=plan.world_size), plan.name)
        except BaseException:
            # A half-formed set is dropped whole: the next forming takes a fresh name and port (the
            # failed rendezvous may still hold this one) and the servers leave what they joined.
            self._drop_group()
            raise
        logger.info("weight broadcast group %s: %d servers, world size %d, %s, %d pipeline stage group(s)", name,
                    len(self.engines), self.world_size, self.backend, len(self._planned))
        self._planned = []

    def _form(self, name: str, port: int, *, rank: int, world_size: int) -> dist.ProcessGroup:
        """Form one group with every server: the controller joins as ``rank`` (and hosts the store),
        the servers' workers follow it; a stage's first rank, rank 0 of a stage group, joins on its own."""
        first = rank + 1
        offsets = [first + sum(e.tp_size for e in self.engines[:i]) for i in range(len(self.engines))]
        futures = {self._pool.submit(e.init_weight_update_group, master_address=self.master_address, master_port=port,
                                     rank_offset=offset, world_size=world_size, group_name=name,
                                     backend=self.backend): e
                   for e, offset in zip(self.engines, offsets)}
        self._joined.append((name, futures, {id(e): getattr(e, "process", None) for e in self.engines}))
        fault_point("fleet_init", 0)
        # The store's rendezvous blocks until every rank joined or timeout_s passed: watched, so a
        # server that died while joining ends the wait at once, not at the deadline.
        group, ended, err = self._watch(
            lambda: join_weight_group(master_address=self.master_address, master_port=port, world_size=world_size,
                                      rank=rank, group_name=name, backend=self.backend, timeout_s=self.timeout_s,
                                      store_master=True),
            "fleet-group", futures)
        if ended != "done" or err is not None:
            self._raise("forming the weight broadcast group", futures, err)
        self._answers("forming the weight broadcast group", futures)
        return group

    def _drop_group(self) -> None:
        """Forget the groups for good, each destroyed (shut down, out of torch's registry; shutting
        down alone freed nothing of a gloo group: one leaked per restart before 2026-11-29), the
        servers' joins kept for ``_leave_stale``. No gloo broadcast of ours is queued on them (each
        was waited for); an NCCL group is aborted, which cancels a broadcast still in flight on a
        watched thread (``destroy_weight_group``: NCCL's shutdown would wait for it)."""
        groups = [self._group, *(g for g, _ in self._stage_groups.values())]
        self._group, self._members, self._stage_groups, self._planned, self._base_name = None, (), {}, [], ""
        self._stale += self._joined
        self._joined = []
        for group in groups:
            if group is not None:
                destroy_weight_group(group, backend=self.backend)

    def _leave_stale(self) -> None:
        """The servers still in the fleet leave the groups dropped since they joined them.

        A group lives on each server until the server destroys it: sockets and threads on gloo, a
        communicator and its GPU buffers on NCCL. Without this, every restart left one on each
        server that survived it (the fleet's re-formed group) and on the restarted one (its reload's
        group of two). Only the joins that succeeded are left, by the process that made them (a
        restart replaces a server's process in place); best effort, at most
        min(timeout_s, 60) s, a failure a warning and never the sync's error: a server that cannot
        leave a broken group still serves the next one.
        """
        stale, self._stale = self._stale, []
        current = {id(e) for e in self.engines}
        leaving: dict[int, tuple[FleetMember, list[str]]] = {}
        for name, joins, processes in stale:
            for future, engine in joins.items():
                # A server restarted since (in place: the same object, a new process) holds none of them.
                same_process = getattr(engine, "process", None) is processes.get(id(engine))
                if id(engine) in current and same_process and future.done() and future.exception() is None:
                    leaving.setdefault(id(engine), (engine, []))[1].append(name)
        if not leaving:
            return
        futures = {self._pool.submit(e.leave_weight_update_groups, names): (e, names) for e, names in leaving.values()}
        done, _ = wait(futures, timeout=min(self.timeout_s, 60.0))
        for future, (engine, names) in futures.items():
            if future not in done:
                logger.warning("%s did not leave weight broadcast group(s) %s within %g s", engine.name,
                               ", ".join(names), min(self.timeout_s, 60.0))
            elif future.exception() is not None:
                logger.warning("%s could not leave weight broadcast group(s) %s: %s", engine.name, ", ".join(names),
                               str(future.exception()).splitlines()[0][:300])

    # ------------------------------------------------------------------ answers and failures

    def _answers(self, what: str, futures: dict, *, drop_group: bool = True, source: str | None = None) -> None:
        """Wait for every server's answer (at most timeout_s); raise naming who failed or did not answer.

        On NCCL the first failure ends the wait: the servers still waiting sit in a collective that
        only aborting the group ends (torch's NCCL watchdog would end this process, but only
        NCCL_TIMEOUT_HEADROOM_S after this deadline: group.collective_timeout_s)."""
        _, pending = wait(futures, timeout=self.timeout_s,
                          return_when=FIRST_EXCEPTION if self.backend == "nccl" else ALL_COMPLETED)
        if pending or any(f.exception() is not None for f in futures if f.done()):
            if drop_group:
                self._drop_group()
            if self.backend == "nccl" and any(f.done() and f.exception() is not None for f in futures):
                wait(futures, timeout=min(self.timeout_s, 30.0))  # the others answer once the group is gone
            self._raise(what, futures, source=source)

    def _fail(self, what: str, err: BaseException | None, futures: dict, source: str | None = None) -> None:
        """Drop the group, give the servers a moment to answer, raise naming who failed; ``err`` is the
        controller's own failure (None: a server's request failed first)."""
        self._drop_group()
        # The servers' requests fail too once the group broke; give them a moment to say so.
        wait(futures, timeout=min(self.timeout_s, 30.0))
        self._raise(what, futures, err, source)

    def _raise(self, what: str, futures: dict, cause: BaseException | None = None, source: str | None = None) -> None:
        raise blame(what, futures, self.engines, timeout_s=self.timeout_s, cause=cause, source=source,
                    exit_grace_s=self.exit_grace_s)
