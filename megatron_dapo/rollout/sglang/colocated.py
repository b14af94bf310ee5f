"""SGLang engines colocated with training on every node: placement, launch, weight sync, memory.

Steps 1 and 7 of the RL step (DESIGN.md) on a multi-node GPU job. Training runs one process
per GPU; the rollout engines live on the same GPUs, so each engine belongs to the training
ranks whose GPUs it uses, and those ranks, not the controller, start it and feed it weights.

Placement (which GPUs each engine uses, which rank leads it): placement.py.

Launch
    Leaders start their servers at once (each in its own process) and wait for health. Every
    rank then all-gathers every engine's address, API key, leader and log path, or the
    error of a leader whose server did not come up; in that case every rank raises (naming
    the engine, its node and log tail) and healthy leaders stop their servers, so no rank is
    left waiting in a later collective. The controller (global rank 0) builds one HTTP client
    per engine (``SGLangEngine`` without a process; its own engine 0 it already holds) and
    the RolloutController spreads generation over all engines of all nodes. Leaders own the
    server processes: death detection with the log tail on every call they make, shutdown.

Weight sync (step 7)
    ``export_hf`` is collective and hands every rank every full HF tensor, on its own GPU.
    All ranks cut the stream into the same buckets (same names, sizes and order). For each
    bucket, each rank copies its tensors into one flat buffer per dtype (flat_bucket.py,
    SGLang's "flattened_bucket"; per-tensor handles on sglang < 0.5.1) and serializes its own
    copy: a CUDA IPC handle to memory on its GPU, which is exactly what the engine's TP
    worker on that GPU opens. The engine's group (a gloo group per engine, built once at
    launch) gathers the strings to the leader, which POSTs /update_weights_from_tensor once
    per dtype with the list in engine TP-rank order (each TP worker takes its full tensors
    and cuts its own shard). The leader then broadcasts the outcome to its
    group, and only then do members drop the bucket and take the next one, so a group moves
    in lockstep with its engine (torch also keeps a block shared over IPC in its "limbo"
    until the server, after syncing its stream, let go of it; ``ipc_collect`` then frees it).
    After the last bucket each leader flushes the radix cache. A failed
    engine's group stops sending but keeps consuming the export (its collectives must stay
    in lockstep with the other ranks); one all-gather at the end makes every rank raise
    an EngineError naming every failed engine.

Restarts (rollout.max_engine_restarts; restarts.py)
    A server that dies while the controller generates is restarted by its leader, which the
    controller's client asks through the job's TCP store; the leader keeps a host copy of the
    last sync's buckets (one copy of the HF weights per leader) and loads it, with the
    version, into the relaunched server. A server found dead at the release before training
    is relaunched at the next resume, whose sync gives it the new weights. Both take from one
    budget for the whole job; a death during the weight sync itself still stops the run.

Memory
    Each rank holds one bucket of full tensors at a time (at most the bucket budget plus
    one tensor) and its flat copy, which the engines read in place through IPC: no tensor
    bytes over the network; only handles (a few hundred bytes per tensor)
    cross processes, over gloo inside a node. Blocks the engine has released go back to the
    caching allocator after every bucket (``torch.cuda.ipc_collect``): the peak stays one bucket.
    Around training, ``release_memory`` (before) and ``resume_memory`` (before the sync)
    are collectives: each leader calls its own engine, and an all-gather makes every rank
    wait until every engine of the job has given back, or taken, its memory. Before the
    resume every rank empties its caching allocator (Megatron's training peak is still
    cached there) and a CPU barrier makes sure all have, since an engine allocates on all
    GPUs of its TP group (DESIGN.md, "Memory hand-over").
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from megatron_dapo.errors import UserError
from megatron_dapo.rollout.engine import EngineError, EngineRestartsExhausted, RolloutEngine
from megatron_dapo.rollout.flat_bucket import (
    WeightFormat,
    WeightPayload,
    default_weight_format,
    encode_bucket,
    payload_tensors,
)
from megatron_dapo.rollout.host_arena import HostArena
from megatron_dapo.rollout.placement import (
    EnginePlacement,
    EngineSlot,
    check_node_layout,
    plan_placement,
    ranks_per_node_from_env,
)
from megatron_dapo.rollout.sglang.protocol import sglang_serialize
from megatron_dapo.rollout.sglang.restarts import RestartChannel, RestartServer, job_store
from megatron_dapo.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    BucketMeter,
    WeightSyncStats,
    iter_buckets,
    with_lm_head_copy,
)

if TYPE_CHECKING:
    pass

__all__ = [
    "ColocatedEngines",
    "EngineInfo",
    "EnginePlacement",
    "EngineSlot",
    "LeaderEngine",
    "plan_placement",
    "ranks_per_node_from_env",
    "serialize_cuda_ipc",
]

logger = logging.getLogger(__name__)

Serializer = Callable[[WeightPayload], str]


# ------------------------------------------------------------------------ engines


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineInfo:
    """What every rank learns about one engine at launch (all-gathered)."""

    name: str
    """Engine name."""
    url: str
    """``http://address:port`` reachable from the other nodes."""
    api_key: str
    """Bearer token of the server."""
    tp_size: int
    """GPUs of the engine."""
    leader_rank: int
    """Global rank that owns the server process."""
    node: int
    """Node index."""
    host: str
    """Host name of the node (for messages)."""
    log_path: str
    """The server's log file on that node."""
    deterministic: bool = False
    """Server runs --enable-deterministic-inference (clients send seeds)."""


class LeaderEngine(Protocol):
    """What a leader needs from the engine it owns (SGLangEngine; a fake in tests)."""

    def check_payload(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Raise if the server could not load these tensors (before anything is sent)."""
        ...

    def update_weights_from_serialized(self, serialized: Sequence[str], *, load_format: str | None = None) -> None:
        """Load one payload, one serialized entry per engine TP rank, in TP-rank order."""
        ...

    def finish_weight_update(self, version: int | None = None) -> None:
        """Drop caches computed with the old weights; set the weights' version."""
        ...

    def release_memory(self) -> None:
        """Give weights and KV cache back for training."""
        ...

    def resume_memory(self) -> None:
        """Take the memory back; weights must be synced afterwards."""
        ...

    def health(self) -> bool:
        """Whether the server answers; raises EngineError with the log tail when its process died."""
        ...

    def shutdown(self) -> None:
        """Stop the server (idempotent)."""
        ...

    @property
    def exited(self) -> bool:
        """Whether the server process has exited."""
        ...

    def relaunch(self) -> None:
        """Kill what is left of the server and launch it again (same port, key, log); checkpoint weights."""
        ...

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load a bucket of full tensors held by this process (a restart's reload)."""
        ...


StartEngine = Callable[[EngineSlot], tuple[LeaderEngine, EngineInfo]]
MakeClient = Callable[[EngineInfo], RolloutEngine]


def serialize_cuda_ipc(payload: WeightPayload) -> str:
    """SGLang's MultiprocessingSerializer of a payload: CUDA IPC handles to this rank's GPU memory.

    The handles name the GPU by UUID (SGLang's torch reduction patch, also applied by its
    servers), so they open correctly even if the server saw a different CUDA_VISIBLE_DEVICES.

    Args:
        payload: a flat buffer of a bucket, or its (hf_name, full tensor) pairs, on this rank's GPU.

    Returns:
        The base64 string one TP worker deserializes.
    """
    for name, tensor in payload_tensors(payload):
        if tensor.device.type != "cuda":
            raise UserError(
                f"colocated weight sync: tensor {name!r} is on {tensor.device}; CUDA IPC needs the export on "
                "this rank's GPU (trainer.device: cuda)"
            )
    return sglang_serialize(payload)


class ColocatedEngines:
    """This rank's share of the job's colocated engines; every rank holds one (collective methods)."""

    def __init__(
        self,
        *,
        placement: EnginePlacement,
        rank: int,
        group: dist.ProcessGroup | None,
        engine: LeaderEngine | None,
        infos: list[EngineInfo],
        clients: list[RolloutEngine],
        serializer: Serializer,
        weight_format: WeightFormat | None = None,
        restarts: RestartChannel | None = None,
        lm_head_copy: bool = False,
    ) -> None:
        """Use :meth:`create` (or launch.launch_colocated_engines); this only stores the parts."""
        self.lm_head_copy = lm_head_copy  # every sync also sends the embedding as lm_head.weight
        self.placement = placement
        self.rank = rank
        self.slot = placement.slot(placement.engine_of(rank))
        self.group = group
        self.engine = engine
        self.infos = infos
        self.clients = clients
        self._serializer = serializer
        self.weight_format: WeightFormat = weight_format or default_weight_format()
        # Barriers of the memory hand-over run on CPU: no NCCL kernel on GPUs the engines use.
        self._cpu_world = dist.new_group(backend="gloo")
        self.restarts = restarts
        # The leader's engine is used by this rank's step and by its restart thread: one at a time.
        self._lock = threading.RLock()
        self._kept: list[list[tuple[str, torch.Tensor]]] = []  # the last sync's buckets, on the host
        self._kept_version: int | None = None
        self._kept_device: torch.device | None = None
        # One host buffer per tensor, reused by every sync, carved from a few blocks pinned at their
        # exact size beside a GPU (rollout/host_arena.py): the last sync's weights for a restart cost
        # one copy of the model per leader plus at most one block's tail, not two at the peak.
        self._host_buffers = HostArena(pin=torch.cuda.is_available())
        self._released = False
        self._dead = False  # found dead at the release: relaunched at the resume
        self._relaunches = 0  # servers restart_owned relaunched (shutdown stops one that came up meanwhile)
        self._restart_server = RestartServer(restarts, self.slot.name, self.restart_owned) \
            if restarts is not None and engine is not None else None

    @property
    def is_leader(self) -> bool:
        """Whether this rank owns an engine's server."""
        return self.engine is not None

    @classmethod
    def create(
        cls,
        placement: EnginePlacement,
        *,
        rank: int,
        local_rank: int,
        start_engine: StartEngine,
        make_client: MakeClient,
        serializer: Serializer | None = None,
        weight_format: WeightFormat | None = None,
        max_restarts: int = 0,
        restart_timeout_s: float = 1800.0,
        lm_head_copy: bool = False,
    ) -> ColocatedEngines:
        """Collective: check the node layout, build the per-engine groups, start and announce engines.

        Args:
            placement: from :func:`plan_placement` (the same on every rank).
            rank: this global rank.
            local_rank: this rank's index on its node.
            start_engine: called on leaders only: start the slot's server, wait until healthy,
                return the owned engine and its info.
            make_client: called on the controller: an HTTP client of another rank's engine.
            serializer: payload -> string for the engine's TP worker on this GPU; default
                :func:`serialize_cuda_ipc`.
            weight_format: how buckets travel; None = flattened where the installed sglang
                has it (flat_bucket.default_weight_format).
            max_restarts: rollout.max_engine_restarts for the whole job; 0 = a dead server
                stops the run. Leaders then keep a host copy of the last sync's weights.
            restart_timeout_s: how long the controller waits for a leader's restart.
            lm_head_copy: the served model needs the tied embedding as lm_head.weight too
                (server.copies_lm_head).

        Returns:
            On leaders ``engine`` is set; on the controller ``clients`` holds every engine.

        Raises:
            UserError: the ranks are not laid out in node blocks.
            EngineError: on every rank, when any engine failed to start.
        """
        check_node_layout(placement, rank=rank, local_rank=local_rank)
        # Built once, by every rank in the same order (new_group is collective over the world).
        # gloo: the payloads are small host strings, and the default group may be NCCL.
        group, _ = dist.new_subgroups_by_enumeration(placement.group_ranks(), backend="gloo")
        slot = placement.slot(placement.engine_of(rank))
        engine: LeaderEngine | None = None
        outcome: tuple[EngineInfo | None, str | None] = (None, None)
        if placement.is_leader(rank):
            try:
                engine, info = start_engine(slot)
                outcome = (info, None)
            except Exception as err:
                outcome = (None, f"{slot.name} (rank {rank} on {socket.gethostname()}): {err}")
        outcomes: list[Any] = [None] * placement.world_size
        dist.all_gather_object(outcomes, outcome)
        errors = [error for _, error in outcomes if error is not None]
        if errors:
            if engine is not None:
                engine.shutdown()
            raise EngineError(f"{len(errors)} colocated SGLang engine(s) failed to start: " + "; ".join(errors))
        infos = [outcomes[placement.slot(e).leader_rank][0] for e in range(placement.num_engines)]
        clients: list[RolloutEngine] = []
        if rank == 0:
            # The controller's own engine (0) keeps its process handle: errors then carry the log tail.
            clients = [engine if e == slot.index and engine is not None else make_client(info)  # type: ignore[misc]
                       for e, info in enumerate(infos)]
        restarts = RestartChannel(job_store(), max_restarts=max_restarts, timeout_s=restart_timeout_s) \
            if max_restarts > 0 else None
        for client in clients:  # the controller asks the owners (restarts.py)
            client.restart_channel = restarts  # type: ignore[attr-defined]
        logger.info("colocated engines: %d on %d node(s), tp %d; this rank: %s tp rank %d%s",
                    placement.num_engines, placement.num_nodes, placement.engine_tp, slot.name,
                    placement.tp_rank_of(rank), " (leader)" if engine is not None else "")
        return cls(placement=placement, rank=rank, group=group, engine=engine, infos=infos, clients=clients,
                   serializer=serializer or serialize_cuda_ipc, weight_format=weight_format, restarts=restarts,
                   lm_head_copy=lm_head_copy)

    # ------------------------------------------------------------------ weight sync

    def sync_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        version: int | None = None,
    ) -> WeightSyncStats:
        """Collective: stream the export into every engine, bucket by bucket (module docstring).

        Args:
            named_tensors: the adapter's export_hf generator: every full tensor on every
                rank, consumed fully here.
            bucket_bytes: budget per bucket (rollout.update_weights_bucket_megabytes).
            version: the weights' version (the step that made them); every engine answers with it after.

        Returns:
            Bytes, tensors and buckets this rank's engine received, seconds, the bucket peak.

        Raises:
            EngineError: on every rank, when any engine failed (names every such engine).
        """
        with self._lock:
            if self.lm_head_copy:
                named_tensors = with_lm_head_copy(named_tensors)
            return self._sync_weights(named_tensors, bucket_bytes, version)

    def _sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                      version: int | None) -> WeightSyncStats:
        start = time.perf_counter()
        meter = BucketMeter()
        failure: str | None = None  # this engine's first failure, known to every rank of its group
        num_bytes = num_tensors = num_buckets = 0
        keep = self._restart_server is not None
        incoming: list[list[tuple[str, torch.Tensor]]] = []
        if keep:  # the buffers are rewritten below: until the sync has passed them all, nothing to reload
            self._kept, self._kept_version = [], None
        for bucket in iter_buckets(named_tensors, bucket_bytes, meter):
            if failure is None:
                failure = self._send_bucket(bucket)
            if keep:  # what a restart of this leader's server loads (restart_owned)
                incoming.append([(name, self._host_copy(name, t)) for name, t in bucket])
                self._kept_device = bucket[0][1].device
            num_buckets += 1
            num_tensors += len(bucket)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            on_cuda = bucket[0][1].is_cuda
            del bucket
            if on_cuda:
                # Blocks shared over IPC wait in torch's limbo until the server let go of them.
                torch.cuda.ipc_collect()
        if keep and self._kept_device is not None and self._kept_device.type == "cuda":
            torch.cuda.current_stream(self._kept_device).synchronize()  # the pinned copies have landed
        if failure is None and self.engine is not None:
            failure = _call(functools.partial(self.engine.finish_weight_update, version=version))
        if keep:  # complete even when the engine failed: a restart then loads this version
            self._kept, self._kept_version = incoming, version
        self._raise_if_any_failed(failure, "weight sync")
        return WeightSyncStats(num_bytes=num_bytes, num_tensors=num_tensors, num_buckets=num_buckets,
                               seconds=time.perf_counter() - start, peak_bucket_bytes=meter.peak_bytes)

    def _host_copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` copied into this name's reused host buffer (allocated on first use or a new shape)."""
        buffer = self._host_buffers.buffer(name, tensor.shape, tensor.dtype)
        buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        return buffer

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> str | None:
        """Flatten, serialize, gather to the leader, POST, share the outcome in the group; returns the failure."""
        payload: list[str] | None = None
        error: str | None = None
        try:
            if self.engine is not None:
                self.engine.check_payload(bucket)  # what the server would die of, refused before sending
            requests = encode_bucket(bucket, self.weight_format)
            payload = [self._serializer(item) for _, item in requests]
        except Exception as err:
            error = f"rank {self.rank}: {type(err).__name__}: {err}"
        if self.slot.tp_size == 1:
            gathered: list[Any] | None = [(payload, error)]
        else:
            gathered = [None] * self.slot.tp_size if self.is_leader else None
            dist.gather_object((payload, error), gathered, group=self.group, group_dst=0)
        status: list[str | None] = [None]
        if gathered is not None:
            errors = [e for _, e in gathered if e is not None]
            if errors:
                status[0] = "; ".join(errors)
            else:
                assert self.engine is not None
                # Every rank flattened the same bucket, so request k is the same dtype everywhere.
                for k, (load_format, _) in enumerate(requests):
                    post = functools.partial(self.engine.update_weights_from_serialized, load_format=load_format)
                    status[0] = _call(post, [p[k] for p, _ in gathered])
                    if status[0] is not None:
                        break
        if self.slot.tp_size > 1:
            # Members hold their bucket until the leader's POST returned: the server reads it in place.
            dist.broadcast_object_list(status, group=self.group, group_src=0)
        return status[0]

    # ------------------------------------------------------------------ memory and lifetime

    def release_memory(self) -> None:
        """Collective: every leader releases its engine's weights and KV cache (before training).

        A leader that can restart and finds its server dead leaves it so: the resume relaunches it.
        """
        failure = None
        if self.engine is not None:
            with self._lock:
                if self._restart_server is not None and self.engine.exited:
                    logger.warning("engine %s: its server is dead at the release; it is relaunched at the next resume",
                                   self.slot.name)
                    self._dead = True
                else:
                    failure = _call(self.engine.release_memory)
                self._released = True
        self._raise_if_any_failed(failure, "release_memory")

    def resume_memory(self, release_cache: Callable[[], None] = lambda: None) -> None:
        """Collective: every leader takes its engine's memory back (before the weight sync).

        Args:
            release_cache: frees this rank's cached allocator memory; every rank calls it,
                and a CPU barrier follows, before any engine allocates on the node's GPUs.
        """
        release_cache()
        dist.barrier(group=self._cpu_world)
        failure = None
        if self.engine is not None:
            with self._lock:
                if self._restart_server is not None and (self._dead or self.engine.exited):
                    failure = self._relaunch_at_resume()
                else:
                    failure = _call(self.engine.resume_memory)
                self._released = False
        self._raise_if_any_failed(failure, "resume_memory")

    # ------------------------------------------------------------------ restarts

    def restart_owned(self) -> None:
        """Relaunch this leader's server and load the last sync's weights with their version.

        Called by the restart thread when the controller asks (restarts.py). A fresh server
        holds its memory: one asked for while released (not in the synchronous loop) gives
        it back again.
        """
        assert self.engine is not None
        with self._lock:
            self.engine.relaunch()
            self._relaunches += 1
            self._dead = False
            device = self._kept_device or torch.device("cpu")
            for bucket in self._kept:
                self.engine.update_weights([(name, t.to(device)) for name, t in bucket])
            if self._kept:
                self.engine.finish_weight_update(version=self._kept_version)
            if self._released:
                self.engine.release_memory()

    def _relaunch_at_resume(self) -> str | None:
        """A server found dead since the last step: relaunch it (the sync that follows loads the weights)."""
        assert self.engine is not None and self.restarts is not None
        if not self.restarts.take():
            return (f"{EXHAUSTED}its server died, and rollout.max_engine_restarts={self.restarts.max_restarts} "
                    "are spent; the run stops here: rerun the same command to resume from the last checkpoint, "
                    "and look at the engine's log for why it died")
        logger.warning("engine %s: its server died since the last step; relaunching it at the resume "
                       "(restart %d of at most %d)", self.slot.name, self.restarts.count(), self.restarts.max_restarts)
        failure = _call(self.engine.relaunch)
        if failure is None:
            self._dead = False
        return failure

    def num_restarts(self) -> int:
        """Restarts of the job's engines so far (every rank reads the same store); 0 without restarts."""
        return self.restarts.count() if self.restarts is not None else 0

    def health(self) -> dict[str, bool]:
        """Collective: every leader asks its own server; the answers of all engines, on every rank.

        Raises:
            EngineError: on every rank, when a leader found its server process dead (log tail included).
        """
        healthy, failure = True, None
        if self.engine is not None:
            try:
                healthy = bool(self.engine.health())
            except Exception as err:
                failure = f"{type(err).__name__}: {err}"
        answers: list[Any] = [None] * self.placement.world_size
        dist.all_gather_object(answers, (self.slot.name, self.is_leader, healthy, failure))
        dead = [f"{name}: {f}" for name, _, _, f in answers if f is not None]
        if dead:
            raise EngineError(f"health failed on {len(dead)} engine(s): " + "; ".join(dead))
        return {name: ok for name, leader, ok, _ in answers if leader}

    def shutdown(self) -> None:
        """Stop this rank's server if it leads one, and its restart thread (not collective; idempotent).

        The thread takes no further request, the server stops (which ends a relaunch under way at
        its next health check instead of after its start-up timeout), the thread ends, and whatever
        a relaunch that had just finished started is stopped too.
        """
        if self._restart_server is not None:
            self._restart_server.stop(wait=False)
        relaunches = self._relaunches
        if self.engine is not None:
            self.engine.shutdown()
        if self._restart_server is not None:
            self._restart_server.stop()
        if self.engine is not None and self._relaunches != relaunches:
            self.engine.shutdown()

    def _raise_if_any_failed(self, failure: str | None, what: str) -> None:
        """All-gather every rank's failure; raise the same EngineError everywhere if any."""
        failures: list[Any] = [None] * self.placement.world_size
        dist.all_gather_object(failures, (self.slot.name, failure))
        by_engine = dict.fromkeys(f"{name}: {f}" for name, f in failures if f is not None)
        if by_engine:
            # A spent restart budget is its own error (train.py prints it as one line).
            error = EngineRestartsExhausted if any(EXHAUSTED in f for f in by_engine) else EngineError
            raise error(f"{what} failed on {len(by_engine)} engine(s): " + "; ".join(by_engine).replace(EXHAUSTED, ""))


EXHAUSTED = "[restarts spent] "
"""Marks a failure text as the end of the restart budget (_raise_if_any_failed)."""


def _call(fn: Callable[..., Any], *args: Any) -> str | None:
    """Run fn; return None, or its error as text (re-raised on every rank by the caller)."""
    try:
        fn(*args)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None
