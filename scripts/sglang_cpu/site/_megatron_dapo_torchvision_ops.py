"""Declares torchvision::nms and torchvision::qnms when torchvision's C++ extension did not load.

Copied into the SGLang CPU venv by scripts/install_sglang_cpu.sh; loaded by _megatron_dapo_torchvision_ops.pth.

PyPI's torchvision 0.28.0 is a CUDA build: its _C extension does not load on CPU torch, and then
`import torchvision` (which sglang does unconditionally) fails in _meta_registrations with
"operator torchvision::nms does not exist" (register_fake needs the op's schema). This finder
declares the two schemas, exactly as torchvision's C++ declares them (csrc/ops/nms.cpp,
csrc/ops/quantized/cpu/qnms_kernel.cpp), just before _meta_registrations runs and only when the
extension did not provide them; torch is not imported at interpreter start.
"""

import importlib.abc
import sys

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # kept alive: a torch.library.Library removes its definitions when collected


class _DeclareBeforeMetaRegistrations(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision._meta_registrations":
            sys.meta_path.remove(self)
            _declare_missing()
        return None  # the ordinary finders import the module


def _declare_missing():
    global _library
    import torch

    missing = [s for s in SCHEMAS if not hasattr(torch.ops.torchvision, s.split("(")[0])]
    if missing:
        _library = torch.library.Library("torchvision", "FRAGMENT")
        for schema in missing:
            _library.define(schema)


sys.meta_path.insert(0, _DeclareBeforeMetaRegistrations())
