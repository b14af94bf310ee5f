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
the server on its own node (engine.py). This module imports vLLM at the top: only
vLLM's processes import it.
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

__all__ = ["BACKEND", "SharedMemoryWeightTransferEngine", "register"]

BACKEND = "megatron_dapo_shm"
"""The backend name passed in ``--weight-transfer-config`` (engine.py)."""


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """No rendezvous: the files carry everything."""


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: a safetensors file of full (unsharded) HF-named tensors."""

    path: str
    """File the trainer wrote; it deletes the file after /update_weights returns."""


class SharedMemoryWeightTransferEngine(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
    """Loads buckets from safetensors files with the model's own weight loader."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        """Nothing to set up: no process group, no handles."""

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
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        """Read the bucket file and load every tensor into the model.

        Args:
            update_info: the bucket's file.
        """
        tensors = load_file(update_info.path, device=str(self.device))
        self.model.load_weights(list(tensors.items()))

    def shutdown(self) -> None:
        """Nothing is held between updates."""


def register() -> None:
    """vLLM plugin entry point: add the backend to vLLM's registry (idempotent).

    vLLM calls general plugins once per process, but a process may load them again
    (forked workers); the factory rejects a second registration of the same name.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # already registered in this process
        WeightTransferEngineFactory.register_engine(BACKEND, SharedMemoryWeightTransferEngine)
