"""The frozen reference policy: log pi_ref of each batch for the KL loss (GRPO ablations; off in DAPO),
and the frozen teacher of on-policy distillation (algorithm.distill.teacher).

With `algorithm.use_kl_loss=true` the loss adds kl_loss_coef x KL(pi || pi_ref), where
pi_ref is the policy the RL run started from. `ReferencePolicy` is a second GPTModel of
the same layout as the actor's pipeline stage (same TP/PP/SP shards, so its forward needs
no communication the actor's does not), loaded once from the starting HF checkpoint and
never trained: no DDP, no gradients, no optimizer state. After a resume it is still the
starting checkpoint, not the resumed weights.

Its forward pass is the actor's own (MegatronActor.compute_log_probs with `model=`), so
micro-batching, temperature and the vocab-parallel log-prob code are shared and, while the
actor has not moved, the two give bitwise the same log-probs: the KL starts at exactly 0.

The distillation teacher is the same class built from the teacher's checkpoint with the
teacher's own adapter: its own architecture (width, depth, heads), sharded in the actor's
TP/PP layout (its heads must divide TP, its layers span PP), with the student's tokenizer.

On GPU the weights live in host memory between uses and are copied in for the one
forward per batch, as verl offloads its reference; on CPU there is nothing to offload.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.actor.microbatch import RolloutBatch

if TYPE_CHECKING:
    from megatron_dapo.models import DecoderAdapter

__all__ = ["BaseOfAdapters", "ReferencePolicy"]


class ReferencePolicy:
    """A frozen copy of the starting policy in the actor's layout.

    Args:
        actor: the actor whose layout, dtype, spec and micro-batching the reference shares.
        hf_checkpoint: the HF checkpoint the run started from (after SFT warm start: its output),
            or the teacher's.
        adapter: the checkpoint's model adapter when it is not the actor's architecture (the teacher).
        offload: keep the weights in host memory between uses; None = exactly on CUDA.
    """

    def __init__(self, actor: MegatronActor, hf_checkpoint: str | Path, *, adapter: DecoderAdapter | None = None,
                 offload: bool | None = None) -> None:
        self.actor = actor
        dims = actor.dims
        adapter = adapter if adapter is not None else actor.adapter
        model = adapter.build_model(dims, init_weights=False, **actor.model_build_kwargs)
        adapter.load_hf(model, hf_checkpoint, dims)
        model.requires_grad_(False)
        model.eval()
        # The same schedule runs it: micro-batches differ in shape between pipeline stages.
        model.config.variable_seq_lengths = dims.pp > 1
        self.model = model
        self.offload = dims.device.type == "cuda" if offload is None else offload
        self._host: dict[str, torch.Tensor] = {}
        if self.offload:
            # Pinned host copies make the copy-in before each forward an asynchronous DMA.
            for name, param in model.named_parameters():
                self._host[name] = param.data.to("cpu").pin_memory()
                param.data = self._host[name]

    def _to_device(self) -> None:
        device = self.actor.dims.device
        for name, param in self.model.named_parameters():
            param.data = self._host[name].to(device, non_blocking=True)

    def compute_log_probs(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        """log pi_ref of this rank's sequences, aligned like batch.input_ids (0 at t = 0 and on padding).

        Collective like MegatronActor.compute_log_probs (model- and data-parallel groups).

        Args:
            batch: this data-parallel rank's sequences.
            temperature: the rollout temperature (the same the loss uses for the actor).

        Returns:
            [B, S] fp32 log-probs on dims.device.
        """
        if self.offload:
            self._to_device()
        try:
            log_probs, _ = self.actor.compute_log_probs(batch, temperature, model=self.model)
        finally:
            if self.offload:
                # Drop the device copies: the host copies are unchanged (frozen), so only rebind.
                for name, param in self.model.named_parameters():
                    param.data = self._host[name]
        return log_probs


class BaseOfAdapters:
    """The reference of a LoRA actor: its own frozen base, the adapters switched off for the pass.

    The policy RL starts from is the base (every B is 0 at the start), so no second copy of the
    weights is built, loaded or offloaded; ReferencePolicy's interface.
    """

    def __init__(self, actor: MegatronActor) -> None:
        if actor.lora is None:
            raise ValueError("BaseOfAdapters needs a LoRA actor (model.lora.rank > 0)")
        self.actor = actor

    def compute_log_probs(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        """log pi_base of this rank's sequences, as ReferencePolicy.compute_log_probs (collective)."""
        with self.actor.lora.disabled():  # type: ignore[union-attr]
            log_probs, _ = self.actor.compute_log_probs(batch, temperature, model=self.actor.model)
        return log_probs
