"""LoRA adapters served by an SGLang server (rollout.lora_sync=adapter): its flags and the adapter swap.

Each step the controller writes the actor's adapters as a PEFT directory (lora/sync.py) and every
engine serves it on the base it started from. Read in sglang 0.5.3, 0.5.18 and 0.5.23
(DESIGN.md "LoRA" has the files and lines):

- The server takes adapters at run time only when started with ``--enable-lora``, and without
  ``--lora-paths`` it needs ``--max-lora-rank`` and ``--lora-target-modules`` (HF's short names,
  ``q_proj`` ... ``down_proj``; PEFT's separate q/k/v and gate/up are stacked into its fused
  ``qkv_proj``/``gate_up_proj``). Two adapters at once (``--max-loras-per-batch 2``): the next
  version is loaded before the previous one goes. The kernels: SGLang's default, ``csgmv``, is
  Triton; a CPU server runs ``torch_native`` (torch ops; 0.5.18 and 0.5.23 have it, 0.5.3 not).
  A GPU server that hands its weights to training (``--enable-memory-saver``) keeps a host copy
  of them (``--enable-weights-cpu-backup``): only the adapter is sent each step, so the base it
  released must come back by itself at the resume.
- ``POST /load_lora_adapter {"lora_name", "lora_path"}`` reads ``adapter_config.json`` and the
  ``*.safetensors`` of a directory (a path that is not one is taken for a Hub repository id) and
  refuses a name it holds ("... because it is already loaded"; 0.5.3 takes it again);
  ``/unload_lora_adapter {"lora_name"}`` waits for the requests that use it and refuses a name it
  does not hold ("LoRA with name ... does not exist"). Both answer HTTP 400 with the reason. A
  request names its adapter in ``/generate``'s ``lora_path`` (a name, despite the field's name);
  the radix cache keys on the adapter's load id, so a new version never reuses KV of the old one.

So each version is a new name, ``policy-v<version>``, loaded and then the previous one unloaded.
A restarted server holds the base only: the controller loads the kept adapter into it again
(controller_sync.py); whoever relaunched it, a load of the name the client holds is sent again, and
an unload the fresh server answers "does not exist" is what it should be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_dapo.rollout.engine import EngineError

__all__ = ["AdapterServing", "lora_launch_args", "lora_modules"]

HF_MODULES = {  # model.lora.target_modules (megatron's names) -> the HF modules SGLang's flag names
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


def lora_modules(targets: Sequence[str]) -> tuple[str, ...]:
    """SGLang's ``--lora-target-modules`` of model.lora's targets (experts: refused by config)."""
    return tuple(m for t in targets for m in HF_MODULES.get(t, ()))


def lora_launch_args(*, rank: int, modules: Sequence[str], device: str, releases_memory: bool) -> list[str]:
    """The launch flags of a server that serves adapters up to ``rank`` on ``modules`` (none if rank 0)."""
    if rank <= 0:
        return []
    if not modules:
        raise ValueError("an SGLang server serving LoRA adapters needs their target modules (lora_modules)")
    args = ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *modules,
            "--max-loras-per-batch", "2"]
    if device == "cpu":
        args += ["--lora-backend", "torch_native"]
    elif releases_memory:
        args.append("--enable-weights-cpu-backup")
    return args


class AdapterServing:
    """The adapter swap of one SGLang server (a mixin of SGLangEngine, through WeightUpdates)."""

    name: str
    _adapter: str | None
    """The adapter requests name (``lora_path``), None = the base; set by SGLangEngine.__init__."""
    _control_timeout_s: float
    _request: Callable[..., Any]

    def load_adapter(self, directory: str | Path, version: int) -> None:
        """Serve the PEFT adapter in ``directory`` from now on (rollout.lora_sync=adapter).

        Loaded under ``policy-v<version>``, then the previous one is unloaded; the requests name
        the new one. The name this client already holds is loaded again: the controller asks it of
        a server restarted by another rank (its owner), which starts from the base only.
        """
        name = f"policy-v{version}"
        try:
            self._request("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(directory)},
                          timeout_s=self._control_timeout_s)
        except EngineError as err:
            if name != self._adapter or "already loaded" not in str(err):
                raise
        previous, self._adapter = self._adapter, name
        if previous is None or previous == name:
            return
        try:
            self._request("POST", "/unload_lora_adapter", {"lora_name": previous},
                          timeout_s=self._control_timeout_s)
        except EngineError as err:
            if "does not exist" not in str(err):  # a server relaunched since its last load holds none
                raise
