"""Lets SGLang's routed-experts capturer start on a machine without an accelerator.

Copied into the SGLang CPU venv by scripts/install_sglang_cpu.sh; loaded by
_megatron_dapo_routes_host_cache.pth.

sglang 0.5.18 keeps every token's routed experts (--enable-return-routed-experts) in a host
buffer that it allocates with ``pin_memory=True`` (state_capturer/base.py, BaseHostCache.__init__),
pinned for asynchronous copies from the GPU. CPU torch refuses pinned memory without an
accelerator ("pin_memory=True requires a CUDA or other accelerator backend"), and the server
died at start. On the CPU backend there is no device copy to overlap, so the same buffer is
allocated unpinned: this finder re-runs that one allocation unpinned when (and only when) the
pinned one is refused; everything else of the class is sglang's.
"""

import importlib.abc
import importlib.machinery
import sys

TARGET = "sglang.srt.state_capturer.base"


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
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


def _patch(module):
    cache = getattr(module, "BaseHostCache", None)
    if cache is None:
        return
    init = cache.__init__
    torch = module.torch

    def __init__(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except RuntimeError as err:
            if "pin_memory" not in str(err):
                raise
            zeros = torch.zeros

            def unpinned_zeros(*a, **k):
                k.pop("pin_memory", None)
                return zeros(*a, **k)

            module.torch = _TorchWith(torch, zeros=unpinned_zeros)
            try:
                init(self, *args, **kwargs)
            finally:
                module.torch = torch

    cache.__init__ = __init__


class _TorchWith:
    """torch with some attributes replaced, for the one module that allocates the buffer."""

    def __init__(self, torch, **replaced):
        self._torch, self._replaced = torch, replaced

    def __getattr__(self, name):
        return self._replaced[name] if name in self._replaced else getattr(self._torch, name)


sys.meta_path.insert(0, _PatchAfterLoad())
