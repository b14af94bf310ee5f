"""The weight-update and memory half of the SGLang engine (SGLangEngine inherits it).

Loading weights (shared memory: CUDA IPC or named CPU files; NCCL broadcast from a
disaggregated trainer), weight-update sessions of sglang >= 0.5.21, pausing generation in
place for an update while requests run, the version every later answer carries, the radix
cache flush, and the memory hand-over around training (release/resume), with the client's
guard against the calls a released server dies of (DESIGN.md "SGLang's own server, and what
it dies of"). The state it reads and writes is set up by SGLangEngine.__init__ (engine.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.rollout.flat_bucket import (
    FLATTENED_BUCKET,
    WeightFormat,
    WeightPayload,
    default_weight_format,
    encode_bucket,
)
from megatron_dapo.rollout.sglang.adapters import AdapterServing
from megatron_dapo.rollout.sglang.protocol import cpu_serialize, sglang_serialize
from megatron_dapo.rollout.weight_sync import with_lm_head_copy

__all__ = ["WeightUpdates", "serializer_for"]


class WeightUpdates(AdapterServing):
    """Weight updates, versions and memory of one SGLang server (a mixin of SGLangEngine); LoRA
    adapters served on its base are AdapterServing's (adapters.py)."""

    # Set by SGLangEngine.__init__ (engine.py).
    name: str
    weight_format: WeightFormat | None
    _tp_size: int
    _serializer: Callable[[WeightPayload], str] | None
    _control_timeout_s: float
    _num_retries: int
    _state_lock: threading.Lock
    _released: bool
    _inflight: dict[int, list[str]]
    _version: int | None
    _call_versions: dict[int, list[int | None]]
    _live_updates: bool
    _paused: bool
    _sessions: bool | None
    _session_open: bool
    _expected_shapes: dict[str, tuple[int, ...]] | None

    _request: Callable[..., Any]  # one HTTP call (SGLangEngine._request)
    _log_hint: Callable[[], str]  # the server's log for error messages

    def _refuse_if_released(self, what: str) -> None:
        if self._released:
            raise EngineError(f"SGLang engine {self.name}: {what} while its memory is released (a released "
                              "server dies of it); resume_memory() and sync the weights first")

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load a bucket through shared memory (colocated engines): CUDA IPC handles for CUDA
        tensors, named shared-memory files for CPU tensors (serializer_for).

        Args:
            bucket: (hf_name, full tensor); they must stay alive until this returns,
                which they do because the server has copied them by then.
        """
        if getattr(self, "lm_head_copy", False):
            bucket = list(with_lm_head_copy(bucket))
        self.check_payload(bucket)
        devices = {t.device.type for _, t in bucket}
        if len(devices) > 1:
            raise ValueError(f"SGLang engine {self.name}: a bucket mixes devices {sorted(devices)}; export the "
                             "weights on one device")
        device = devices.pop() if devices else "cpu"
        serializer = self._serializer or serializer_for(device)
        weight_format = self.weight_format or (default_weight_format() if device == "cuda" else FLATTENED_BUCKET)
        for load_format, item in encode_bucket(bucket, weight_format):
            # One process holds the payload; each TP worker still gets a serialization of its own.
            self.update_weights_from_serialized([serializer(item) for _ in range(self._tp_size)],
                                                load_format=load_format)

    def check_payload(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Refuse, before sending, tensors the server's model does not have (it would die of them)."""
        if self._expected_shapes is None:
            return
        for name, tensor in bucket:
            want = self._expected_shapes.get(name)
            if want is None:
                raise EngineError(f"SGLang engine {self.name}: weight update names {name!r}, which the served "
                                  "checkpoint does not have (SGLang's loader raises on it and the server dies); "
                                  "the trainer's model and rollout checkpoint disagree")
            if tuple(tensor.shape) != want:
                raise EngineError(f"SGLang engine {self.name}: weight update sends {name!r} with shape "
                                  f"{tuple(tensor.shape)}, the served checkpoint has {want}")

    def update_weights_from_serialized(self, serialized: Sequence[str], *, load_format: str | None = None) -> None:
        """POST one payload already serialized per TP rank (colocated.py gathers one per GPU).

        Args:
            serialized: entry r is what the server's TP worker r deserializes: full tensors
                (the worker cuts its own shard); len == the server's TP size.
            load_format: "flattened_bucket" for a flat buffer, None for (name, tensor) pairs.
        """
        with self._state_lock:
            self._refuse_if_released("a weight update")
        if len(serialized) != self._tp_size:
            raise ValueError(
                f"SGLang engine {self.name}: got {len(serialized)} serialized buckets for tp_size={self._tp_size}; "
                "send one per TP rank"
            )
        self._pause_for_update()
        self._begin_weight_update()
        payload = {"serialized_named_tensors": list(serialized), "load_format": load_format, "flush_cache": False}
        self._request("POST", "/update_weights_from_tensor", payload, timeout_s=self._control_timeout_s)

    def _pause_for_update(self) -> None:
        """Before an update's first bucket: pause generation in place when weights arrive mid-stream.

        SGLang 0.5.18 (tokenizer_manager.py) holds a reader lock on the model for a request's
        whole life and takes the writer lock per weight update, so an update without a pause
        waits for every request in flight; with generation paused (mode "in_place": the
        scheduler keeps its running batch and KV cache) the update skips the lock and the rows
        go on under the new weights after /continue_generation. Requests sent meanwhile wait in
        the server until then. Paused, /flush_cache fails while rows are held: buckets go with
        flush_cache false (as always) and finish_weight_update does not flush.
        """
        with self._state_lock:
            if self._paused or not (self._live_updates or self._inflight):
                return
            self._paused = True
        try:
            self._request("POST", "/pause_generation", {"mode": "in_place"}, timeout_s=self._control_timeout_s)
        except BaseException:
            with self._state_lock:
                self._paused = False
            raise

    def _begin_weight_update(self) -> None:
        """Open the server's weight-update session before the first bucket (sglang >= 0.5.21).

        A session a failed sync left open is closed and opened again; a server without
        sessions (404) is remembered and never asked again.
        """
        if self._session_open or self._sessions is False:
            return
        for attempt in range(2):
            try:
                self._request("POST", "/begin_weight_update", {}, timeout_s=self._control_timeout_s)
            except EngineError as err:
                if "HTTP 404" in str(err):
                    self._sessions = False
                    return
                if attempt == 0 and "already open" in str(err):
                    self._request("POST", "/end_weight_update", {}, timeout_s=self._control_timeout_s)
                    continue
                raise
            break
        self._sessions = self._session_open = True

    def init_weight_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        """Ask the server to join a broadcast group with the trainer (separate rollout GPUs).

        Blocks until every member joined: call it in a thread while the trainer runs
        :func:`create_weight_update_group`.

        Args:
            master_address: trainer-side store address.
            master_port: trainer-side store port.
            rank_offset: rank of this engine's TP rank 0 in the group (trainer is rank 0).
            world_size: 1 + the TP sizes of all engines in the group.
            group_name: shared name of the group.
            backend: "nccl" on GPUs.
        """
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        self._request("POST", "/init_weights_update_group", payload, timeout_s=self._control_timeout_s)

    def update_weights_from_distributed(
        self, bucket: Sequence[tuple[str, torch.Tensor]], *, group: dist.ProcessGroup, group_name: str
    ) -> None:
        """Send a bucket over the trainer<->engine broadcast group.

        The server receives inside the HTTP call, so the call runs in a thread while this
        rank broadcasts each tensor from rank 0 of ``group``.

        Args:
            bucket: (hf_name, full tensor on this rank's GPU).
            group: the group from :func:`create_weight_update_group`.
            group_name: the name the server joined with.
        """
        errors: list[BaseException] = []

        def post() -> None:
            try:
                self.receive_distributed(bucket, group_name=group_name)
            except BaseException as err:
                errors.append(err)

        thread = threading.Thread(target=post, name=f"{self.name}-weights")
        thread.start()
        for _, tensor in bucket:
            group.broadcast([tensor.contiguous()], dist.BroadcastOptions()).wait()
        thread.join()
        if errors:
            raise errors[0]

    def receive_distributed(self, bucket: Sequence[tuple[str, torch.Tensor]], *, group_name: str,
                            load_format: str | None = None, timeout_s: float | None = None) -> None:
        """The request by which the server receives one bucket over the broadcast group: it
        allocates each tensor (names, dtypes and shapes from ``bucket``; the values are not read)
        and returns once its broadcast finished and the weights are loaded. The caller broadcasts.

        Args:
            load_format: "flattened_bucket": one broadcast of the bucket's tensors as bytes,
                concatenated in order (fleet/broadcast.py); None: one broadcast per tensor.
            timeout_s: the HTTP deadline (default: the control timeout).
        """
        with self._state_lock:
            self._refuse_if_released("a weight update")
        self.check_payload(bucket)
        self._pause_for_update()
        self._begin_weight_update()
        payload = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": group_name,
            "flush_cache": False,
            **({"load_format": load_format} if load_format is not None else {}),
        }
        self._request("POST", "/update_weights_from_distributed", payload,
                      timeout_s=timeout_s if timeout_s is not None else self._control_timeout_s)

    def destroy_weight_update_group(self, group_name: str) -> None:
        """Ask the server to leave the broadcast group (the trainer then calls ``group.shutdown()``:
        the group is not registered with torch's default world, so destroy_process_group
        raises KeyError on it)."""
        self._request("POST", "/destroy_weights_update_group", {"group_name": group_name},
                      timeout_s=self._control_timeout_s)

    def leave_weight_update_groups(self, group_names: Sequence[str]) -> None:
        """Leave groups the fleet dropped (FleetMember; rollout/fleet/broadcast.py ``_leave_stale``):
        sglang 0.5.18 keeps every group it joined, by name, until it is destroyed. Every name is
        tried; the first failure is raised after."""
        errors = []
        for name in group_names:
            try:
                self.destroy_weight_update_group(name)
            except EngineError as err:
                errors.append(err)
        if errors:
            raise errors[0]

    def finish_weight_update(self, version: int | None = None) -> None:
        """Close the weight-update session, flush the radix cache built on the old weights, and
        set the server's weight version, which every later answer carries and this client checks.
        After a paused update (live updates, or requests in flight) nothing is flushed and
        generation continues in place.

        Args:
            version: the trainer step that made the weights; None leaves the server's as is.
        """
        try:
            if self._session_open:
                self._session_open = False
                self._request("POST", "/end_weight_update", {}, timeout_s=self._control_timeout_s)
            if not self._paused:
                self.flush_cache()
            if version is not None:
                with self._state_lock:
                    # Calls in flight may now answer this version too (their rows span both).
                    for versions in self._call_versions.values():
                        versions.append(version)
                    self._version = version
                # abort_all_requests false: the rows paused in place must survive the version change.
                self._request("POST", "/update_weight_version",
                              {"new_version": str(version), "abort_all_requests": False},
                              timeout_s=self._control_timeout_s)
        finally:
            if self._paused:
                self._paused = False
                # torch_empty_cache false: nothing to return to a driver (a CPU server has none).
                self._request("POST", "/continue_generation", {"torch_empty_cache": False},
                              timeout_s=self._control_timeout_s, retries=self._num_retries)

    def flush_cache(self, *, timeout_s: float = 120.0) -> None:
        """GET /flush_cache until it succeeds (SGLang refuses while requests are running).

        Args:
            timeout_s: give up after this long.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._request("GET", "/flush_cache", timeout_s=self._control_timeout_s)
                return
            except EngineError as err:
                if time.monotonic() > deadline or "HTTP 400" not in str(err):
                    raise
            time.sleep(0.5)

    def release_memory(self) -> None:
        """Release weights, KV cache and CUDA graphs (tags null = all) for training.

        Raises:
            EngineError: already released, or this client still has requests in flight
                (SGLang asserts an idle server and dies otherwise).
        """
        with self._state_lock:
            self._refuse_if_released("release_memory")
            if self._inflight:
                raise EngineError(f"SGLang engine {self.name}: release_memory while {len(self._inflight)} generate "
                                  "call(s) run (the server asserts it is idle and dies); abort and wait for them first")
            self._released = True  # from here on nothing else may reach the server
        try:
            self.flush_cache()  # answers 400 until the scheduler is fully idle
            self._request("POST", "/release_memory_occupation", {"tags": None}, timeout_s=self._control_timeout_s)
        except BaseException:
            with self._state_lock:
                self._released = False
            raise

    def resume_memory(self) -> None:
        """Re-allocate the released memory; weights must be synced afterwards.

        Raises:
            EngineError: the engine is not released (SGLang's resume without a release raises
                KeyError in the scheduler and the server dies).
        """
        with self._state_lock:
            if not self._released:
                raise EngineError(f"SGLang engine {self.name}: resume_memory without release_memory (the server "
                                  "dies of it); release first, or do not resume")
        self._request("POST", "/resume_memory_occupation", {"tags": None}, timeout_s=self._control_timeout_s)
        with self._state_lock:
            self._released = False

    @property
    def released(self) -> bool:
        """Whether the engine's memory is released (nothing but resume_memory may be sent)."""
        return self._released


def serializer_for(device: str) -> Callable[[WeightPayload], str]:
    """How a payload of tensors on `device` reaches the server's workers.

    CUDA: SGLang's own serializer, CUDA IPC handles (sglang is installed beside the
    trainer on GPU machines). CPU: :func:`protocol.cpu_serialize`, named shared-memory
    files written without sglang (its CPU server lives in an environment of its own).
    """
    return sglang_serialize if device == "cuda" else cpu_serialize

