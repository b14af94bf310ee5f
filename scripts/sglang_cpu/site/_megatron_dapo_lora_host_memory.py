"""Lets SGLang serve LoRA adapters on a machine without an accelerator.

Copied into the SGLang CPU venv by scripts/install_sglang_cpu.sh; loaded by
_megatron_dapo_lora_host_memory.pth.

sglang 0.5.18's LoRA layers and its torch_native LoRA backend ask for pinned host memory, for
asynchronous copies to the GPU: ``torch.tensor(..., pin_memory=True)`` in every linear's
``__init__`` (srt/lora/layers.py: ColumnParallelLinearWithLoRA's ``output_offset_cpu``, line 453,
and five more), ``torch.zeros(..., pin_memory=True)`` and ``Tensor.pin_memory()`` in
``prepare_lora_batch`` (srt/lora/backend/torch_backend.py, lines 225-244). CPU torch refuses
pinned memory without an accelerator ("pin_memory=True requires a CUDA or other accelerator
backend"; ``pin_memory()``: "Cannot access accelerator device when none is available"), and a
server started with --enable-lora died at start. On the CPU backend there is no device copy to
overlap, so those tensors are made unpinned: in those two modules the factories drop
``pin_memory`` when the pinned allocation is refused, and ``Tensor.pin_memory()`` returns an
unpinned copy where it would have raised that refusal (the one method call cannot be scoped to a
module; a call that succeeds is untouched). Everything else is sglang's.
"""

import importlib.abc
import importlib.machinery
import sys

TARGETS = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")
FACTORIES = ("tensor", "zeros", "empty", "ones", "full", "arange")


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.pending = set(TARGETS)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


def _refused(err):
    text = str(err)
    return "pin_memory" in text or "pinned memory" in text or "accelerator device when none is available" in text


def _unpinned(factory):
    def call(*args, **kwargs):
        try:
            return factory(*args, **kwargs)
        except RuntimeError as err:
            if not kwargs.get("pin_memory") or not _refused(err):
                raise
            kwargs.pop("pin_memory")
            return factory(*args, **kwargs)

    return call


def _patch(module):
    torch = getattr(module, "torch", None)
    if torch is None or isinstance(torch, _TorchWith):
        return
    module.torch = _TorchWith(torch, **{name: _unpinned(getattr(torch, name)) for name in FACTORIES})
    pin = torch.Tensor.pin_memory
    if getattr(pin, "_megatron_dapo_unpinned", False):
        return

    def pin_memory(self, *args, **kwargs):
        try:
            return pin(self, *args, **kwargs)
        except RuntimeError as err:
            if not _refused(err):
                raise
            return self.clone()  # pin_memory() returns a copy; so does its stand-in

    pin_memory._megatron_dapo_unpinned = True
    torch.Tensor.pin_memory = pin_memory


class _TorchWith:
    """torch with some attributes replaced, for the modules that ask for pinned memory."""

    def __init__(self, torch, **replaced):
        self._torch, self._replaced = torch, replaced

    def __getattr__(self, name):
        return self._replaced[name] if name in self._replaced else getattr(self._torch, name)


sys.meta_path.insert(0, _PatchAfterLoad())
