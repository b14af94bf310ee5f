"""The weight-update half of the vLLM engine (VLLMEngine inherits it): shared memory, or a fleet's broadcast.

Two ways in, chosen when the server starts (``--weight-transfer-config``, transfer.py):

- ``megatron_dapo_shm`` (one server on the trainer's node): each bucket is a safetensors file in
  /dev/shm that the workers load (``update_weights``); after the update the prefix cache, built
  on the old weights, is reset.
- ``megatron_dapo_broadcast`` (a fleet, rollout/fleet/broadcast.py): the server's workers join
  the controller's group (``init_weight_update_group``) and take each bucket's bytes by broadcast
  (``receive_distributed``). Weights arrive while the server generates (the asynchronous loop),
  so an update pauses the scheduler first (``/pause?mode=keep``: running requests are frozen
  with their KV cache, new ones queue) and vLLM's layerwise reload never meets a forward pass
  with half the layers loaded. After the last bucket, ``/finish_weight_update`` sets the version
  and ``/reset_prefix_cache?reset_running_requests=true`` preempts the frozen requests (their KV
  is recomputed, under the new weights, when they are scheduled again) and empties the prefix
  cache, so no KV computed under old weights serves a token after the update; then ``/resume``.
  vLLM labels every output token with the version in force (``weight_versions`` spans of the
  generate answer), so a response reports exactly the versions it spans.

  A server restarted alone is loaded by its fleet (WeightBroadcast.reload: a group of the
  controller and this server only); the fleet's group is formed again, with it, before the next
  sync.

Read in vllm 0.32.0 (entrypoints/rl/online/api_router.py, v1/engine/core.py ``pause_scheduler``
and ``_reset_caches``, v1/core/sched/scheduler.py ``reset_prefix_cache``, v1/worker/gpu_worker.py
``update_weights``, v1/engine/output_processor.py ``track_weight_version``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["BROADCAST_BACKEND", "SHM_BACKEND", "WeightTransfer"]

SHM_BACKEND = "megatron_dapo_shm"
"""The shared-memory backend's name in ``--weight-transfer-config`` (transfer.py registers it)."""
BROADCAST_BACKEND = "megatron_dapo_broadcast"
"""The fleet's backend name (transfer.py registers it)."""


class WeightTransfer:
    """Weight updates of one vLLM server (a mixin of VLLMEngine; its state is set by VLLMEngine.__init__)."""

    name: str
    broadcast: bool
    """The server runs the broadcast backend (a fleet member)."""
    _updating: bool
    _paused: bool
    _bucket_dir: Path
    _adapter: str | None
    """The LoRA adapter requests name (load_adapter), None = the base."""

    def _post(self, path: str, payload: dict[str, Any] | None = None, *, timeout_s: float | None = None,
              text: bool = False) -> Any:
        raise NotImplementedError  # VLLMEngine

    _tp_size: int

    @property
    def tp_size(self) -> int:
        """Workers of the server in the broadcast group: its TP size (1 on CPU)."""
        return self._tp_size

    # ------------------------------------------------------------------ both backends

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket through a shared-memory file (a fleet member takes broadcasts only).

        Args:
            bucket: (hf_name, full tensor).
        """
        if self.broadcast:
            from megatron_dapo.rollout.engine import EngineError

            raise EngineError(f"vLLM engine {self.name} takes weights by broadcast only (a fleet member): "
                              "use its fleet's WeightBroadcast")
        from safetensors.torch import save_file

        self._open_update()
        path = self._bucket_dir / f"bucket-{uuid.uuid4().hex[:12]}.safetensors"
        try:
            save_file({name: t.detach().to("cpu").contiguous() for name, t in bucket}, str(path))
            self._post("/update_weights", {"update_info": {"path": str(path)}})
        finally:
            path.unlink(missing_ok=True)

    def finish_weight_update(self, version: int | None = None) -> None:
        """End the update: the version (fleet), no KV of old weights left, generation resumed.

        Args:
            version: the new weights' version; a fleet member labels its tokens with it. The
                server on the trainer's node (synchronous, never ahead of the trainer) is not told.
        """
        if self._updating:
            self._updating = False
            body = {"weight_version": str(version)} if self.broadcast and version is not None else {}
            self._post("/finish_weight_update", body)
        if self.broadcast:
            # Frozen requests are preempted (recomputed under the new weights when scheduled).
            self._post("/reset_prefix_cache?reset_running_requests=true")
            if self._paused:
                self._post("/resume")
                self._paused = False
        else:
            self._post("/reset_prefix_cache")

    def _open_update(self) -> None:
        if self._updating:
            return
        if self.broadcast and not self._paused:
            self._post("/pause?mode=keep&clear_cache=false")
            self._paused = True
        self._post("/start_weight_update")
        self._updating = True

    # ------------------------------------------------------------------ LoRA adapters (rollout.lora_sync=adapter)

    def load_adapter(self, directory: str | Path, version: int) -> None:
        """Serve the PEFT adapter in ``directory`` from now on (rollout.lora_sync=adapter).

        It is loaded under a new name (``policy-v<version>``: vLLM refuses a loaded name, and its
        prefix cache keys on the adapter), then the previous one is unloaded; requests name the
        new one. A restarted server starts with the base only: the controller loads it again.
        """
        name = f"policy-v{version}"
        if name == self._adapter:
            return
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(directory)}, text=True)
        previous, self._adapter = self._adapter, name
        if previous is not None:
            self._post("/v1/unload_lora_adapter", {"lora_name": previous}, text=True)

    # ------------------------------------------------------------------ a fleet member (FleetMember)

    def init_weight_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int, group_name: str, backend: str = "gloo",
                                 timeout_s: float = 600.0) -> None:
        """The server's workers join the controller's group; returns once every member joined."""
        info = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend, "timeout_s": timeout_s}
        self._post("/init_weight_transfer_engine", {"init_info": info}, timeout_s=timeout_s + 30.0)

    def leave_weight_update_groups(self, group_names: Sequence[str]) -> None:
        """Nothing to ask (FleetMember): the transfer engine leaves, for good, every group it holds
        when it joins one of a new fleet name (transfer.py ``init_transfer_engine``), which the
        fleet's next forming is. vLLM's own ``/shutdown_weight_transfer_engine`` would drop every
        group, not those named: a call that the fleet stopped waiting for and the server answered
        late would take the new group with it."""

    def receive_distributed(self, bucket: Sequence[tuple[str, torch.Tensor]], *, group_name: str,
                            load_format: str | None = None, timeout_s: float | None = None) -> None:
        """Receive one bucket by the group's broadcast (the controller sends it while this waits).

        ``load_format`` is always the flattened bucket here (one wire format for both fleets).
        """
        self._open_update()
        info = {"names": [n for n, _ in bucket], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": group_name}
        self._post("/update_weights", {"update_info": info}, timeout_s=timeout_s)
