"""Server side of the vLLM engine's weight sync: a vLLM weight-transfer backend over shared memory.

vLLM (>= 0.32) takes new weights during RL through its own weight-transfer API: the server
(run with ``--weight-transfer-config '{"backend": ...}'`` and VLLM_SERVER_DEV_MODE=1) exposes
POST /init_weight_transfer_engine, /start_weight_update, /update_weights and
/finish_weight_update, and each worker hands every /update_weights payload to the
configured backend (``vllm.distributed.weight_transfer.WeightTransferEngine``). vLLM's own
backends move bytes over NCCL or CUDA IPC, neither of which exists on a CPU machine, so this
module adds one more backend, registered with vLLM's ``WeightTransferEngineFactory`` through
vLLM's plugin entry point (``vllm.general_plugins`` in setup.py; vLLM loads it in every
server and worker process):

- the trainer writes each bucket as a safetensors file into shared memory (/dev/shm when the
  machine has it) and POSTs ``{"update_info": {"path": ...}}``;
- the worker maps the file and feeds the tensors to the model's own ``load_weights`` inside
  vLLM's layerwise reload (``start_weight_update`` / ``finish_weight_update``), exactly as
  vLLM's CUDA-IPC backend does with the tensors it rebuilds from handles (the reload re-runs
  the CPU kernels' weight packing, so plain in-place copies are not enough), then ties a
  tied lm_head to the new embedding again and packs reloaded MoE experts for the CPU kernel
  (which vLLM 0.32's reload skips, below).

The server and the trainer share the machine's filesystem because the controller launches
the server on its own node (engine.py).

A fleet (``rollout.placement=disaggregated``, rollout/fleet/broadcast.py) shares no memory with
the trainer, so its servers run a second backend, ``megatron_dapo_broadcast``: at
/init_weight_transfer_engine every TP/PP worker joins the controller's process group (gloo on
CPU, NCCL on GPUs; rank = dp_index x TP x PP + worker rank + rank_offset, as vLLM's NCCL backend
counts) with the recipe the controller and SGLang's servers use (rollout/fleet/group.py), and each
/update_weights names the bucket's tensors (names, dtypes, shapes) whose bytes then arrive, as
one flat buffer, by a broadcast from rank 0 (SGLang's ``flattened_bucket`` layout: one wire
format for both fleets). Loading is the same layerwise reload as above.

This module imports vLLM at the top: only vLLM's processes import it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megatron_dapo.rollout.vllm.weights import BROADCAST_BACKEND, SHM_BACKEND

__all__ = ["BACKEND", "BROADCAST_BACKEND", "BroadcastWeightTransferEngine", "SharedMemoryWeightTransferEngine",
           "register"]

BACKEND = SHM_BACKEND
"""The backend name passed in ``--weight-transfer-config`` (engine.py); the names live in weights.py,
which imports no vLLM."""


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """No rendezvous: the files carry everything."""


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: a safetensors file of full (unsharded) HF-named tensors."""

    path: str
    """File the trainer wrote; it deletes the file after /update_weights returns."""


@dataclass
class BroadcastInitInfo(WeightTransferInitInfo):
    """The controller's group to join (rollout/fleet/broadcast.py forms it as rank 0)."""

    master_address: str
    master_port: int
    rank_offset: int
    """Rank of this server's first worker (1 + the sizes of the servers before it)."""
    world_size: int
    """1 + the workers of every server of the fleet."""
    group_name: str
    backend: str = "gloo"
    timeout_s: float = 600.0


@dataclass
class BroadcastUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: its tensors' names, dtypes and shapes; their bytes follow by broadcast."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    group_name: str = ""
    """The group the controller broadcasts on (checked against the joined one)."""


class _LayerwiseReload:
    """vLLM's layerwise reload around an update, and what vLLM 0.32 leaves undone after it (mixin)."""

    model: torch.nn.Module
    model_config: Any
    device: torch.device

    def start_weight_update(self) -> None:
        """Begin vLLM's layerwise reload (weights arrive in checkpoint format)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """Finish the layerwise reload: the model runs on the new weights from the next step."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        reloaded = self._reloaded_experts()
        finalize_layerwise_reload(self.model, self.model_config)
        self._retie_word_embeddings()
        self._pack_experts(reloaded)

    def _reloaded_experts(self) -> list[torch.nn.Module]:
        """The MoE expert layers (vLLM's RoutedExperts, unquantized) that this update loaded, on CPU.

        vLLM's reload bookkeeping says which: a layer whose weights all arrived was processed
        during loading (its info reset, so it cannot load any more); one with only some of them
        is processed by finalize. Call before finalize_layerwise_reload resets the rest.
        """
        if self.device.type != "cpu":
            return []
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        layers = [m for m in self.model.modules()
                  if "w13_weight" in m._parameters and isinstance(getattr(m, "quant_method", None),
                                                                   UnquantizedFusedMoEMethod)]
        return [m for m in layers
                if not get_layerwise_info(m).can_load() or get_layerwise_info(m).load_numel > 0]

    @staticmethod
    def _pack_experts(layers: list[torch.nn.Module]) -> None:
        """Pack reloaded experts into the CPU MoE kernel's layout, as vLLM does at the first load only.

        vLLM 0.32's UnquantizedFusedMoEMethod._setup_kernel runs the experts kernel's own
        ``process_weights_after_loading`` (on CPU: ``cpu_prepack_moe_weight`` of w13 and w2,
        CPUUnquantizedExperts in experts/cpu_moe.py) only while ``moe_kernel`` is None, i.e. at
        the first load; a reload leaves the checkpoint layout where the kernel reads packed
        weights. Measured on the tiny Qwen3-MoE: re-sending the served weights moved the
        log-probs from transformers' by 9.5e-2 (1.6e-7 before). This repeats the skipped call
        on exactly the layers this update loaded (packing twice would corrupt them).
        """
        for layer in layers:
            layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    def _retie_word_embeddings(self) -> None:
        """Share the embedding with lm_head again after a reload (tie_word_embeddings models).

        The layerwise reload gives embed_tokens a new weight tensor, while lm_head still holds
        the one it was tied to at load time (and, on CPU, a GEMM plan packed from it):
        generation then scores tokens with the first weights (the tiny run's engine-vs-actor log-prob gap grew from 4e-7 at step 1 to
        7.7e-3 by step 59). vLLM ties them at construction with ``ParallelLMHead.tie_weights``;
        this repeats that call.
        """
        hf_config = getattr(self.model_config, "hf_config", None)
        lm_head = getattr(self.model, "lm_head", None)
        embed_tokens = getattr(getattr(self.model, "model", None), "embed_tokens", None)
        if getattr(hf_config, "tie_word_embeddings", False) and lm_head is not None and embed_tokens is not None:
            self.model.lm_head = lm_head.tie_weights(embed_tokens)
            # On CPU the head computes logits from a GEMM plan packed from its weight when it was
            # loaded (UnquantizedEmbeddingMethod -> dispatch_cpu_unquantized_gemm): re-pack it.
            quant_method = getattr(self.model.lm_head, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(self.model.lm_head)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one bucket (synchronously; the base class would synchronize an accelerator)."""
        self.receive_weights(self.parse_update_info(update_info))  # type: ignore[attr-defined]
        if self.device.type != "cpu":
            torch.accelerator.synchronize()


class SharedMemoryWeightTransferEngine(_LayerwiseReload,
                                       WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
    """Loads buckets from safetensors files with the model's own weight loader."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        """Nothing to set up: no process group, no handles."""

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        """Read the bucket file and load every tensor into the model.

        Args:
            update_info: the bucket's file.
        """
        tensors = load_file(update_info.path, device=str(self.device))
        self.model.load_weights(list(tensors.items()))

    def shutdown(self) -> None:
        """Nothing is held between updates."""


class BroadcastWeightTransferEngine(_LayerwiseReload, WeightTransferEngine[BroadcastInitInfo, BroadcastUpdateInfo]):
    """Receives buckets by broadcast from rank 0 of a fleet's groups (the controller, or a pipeline stage's first rank)."""

    init_info_cls = BroadcastInitInfo
    update_info_cls = BroadcastUpdateInfo

    _groups: dict[str, Any] | None = None
    _fleet: str = ""

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        """Join one of the controller's groups; returns once every member joined or ``timeout_s`` passed.

        A fleet forms one group for the controller's buckets and, with pipeline stages, one per
        further stage (fleet/stages.py), all named ``<fleet>`` or ``<fleet>-stage<s>``: a group of
        a new fleet name (formed again after a failure or restart) drops the ones held before.
        """
        from megatron_dapo.rollout.fleet.group import join_weight_group

        fleet = init_info.group_name.rsplit("-stage", 1)[0]
        if fleet != self._fleet:
            self.shutdown()
            self._fleet = fleet
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        group = join_weight_group(master_address=init_info.master_address, master_port=init_info.master_port,
                                  world_size=init_info.world_size, rank=rank, group_name=init_info.group_name,
                                  backend=init_info.backend, timeout_s=init_info.timeout_s)
        self._groups = {**(self._groups or {}), init_info.group_name: group}

    def receive_weights(self, update_info: BroadcastUpdateInfo) -> None:
        """Join the bucket's broadcast (one flat buffer of its bytes) and load its tensors."""
        import torch.distributed as dist

        from megatron_dapo.rollout.fleet.group import flat_nbytes, on_device, split_flat

        groups = self._groups or {}
        if not groups:
            raise RuntimeError("megatron_dapo_broadcast: /update_weights before /init_weight_transfer_engine")
        name = update_info.group_name or (next(iter(groups)) if len(groups) == 1 else "")
        group = groups.get(name)
        if group is None:
            raise RuntimeError(f"megatron_dapo_broadcast: the bucket is sent on group {update_info.group_name!r}, "
                               f"this worker joined {sorted(groups)}")
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        nbytes = flat_nbytes(dtypes, update_info.shapes)
        on_cpu = dist.get_backend(group) == "gloo"
        flat = torch.empty(nbytes, dtype=torch.uint8, device="cpu" if on_cpu else self.device)
        # NCCL binds its communicator (made at the first broadcast) to the calling thread's current
        # device: the worker's own GPU, made explicit for the TP-1 server whose calls run on its
        # engine core's thread (vllm 0.32 uniproc_executor.py).
        with on_device(flat):
            group.broadcast([flat], dist.BroadcastOptions()).wait()
        tensors = split_flat(flat, dtypes, update_info.shapes)
        self.model.load_weights([(n, t if t.device == self.device else t.to(self.device))
                                 for n, t in zip(update_info.names, tensors)])

    def shutdown(self) -> None:
        """Leave the groups for good (the controller forms new ones after any failure or restart).

        Runs between this worker's RPCs, so no collective is running on them (fleet/group.py
        ``destroy_weight_group``)."""
        from megatron_dapo.rollout.fleet.group import destroy_weight_group

        groups, self._groups, self._fleet = self._groups or {}, None, ""
        for group in groups.values():
            destroy_weight_group(group)


def register() -> None:
    """vLLM plugin entry point: add the backend to vLLM's registry (idempotent).

    vLLM calls general plugins once per process, but a process may load them again
    (forked workers); the factory rejects a second registration of the same name.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, engine in ((BACKEND, SharedMemoryWeightTransferEngine),
                         (BROADCAST_BACKEND, BroadcastWeightTransferEngine)):
        with contextlib.suppress(ValueError):  # already registered in this process
            WeightTransferEngineFactory.register_engine(name, engine)
