"""What the SGLang CPU venv holds, asked of its own interpreter (tests only).

The venv is a separate Python (scripts/install_sglang_cpu.sh); its facts are read by running it.
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache

from megatron_dapo.rollout.sglang.server import sglang_python

_ASK = """
import json, torch, sgl_kernel
from sglang.srt.utils.common import cpu_has_amx_support
print(json.dumps({
    "standin": bool(getattr(sgl_kernel, "MEGATRON_DAPO_STANDIN", False)),
    "kernel_file": sgl_kernel.__file__,
    "torch_amx_tile": bool(torch.cpu._is_amx_tile_supported()),
    "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    "sglang_amx_path": bool(cpu_has_amx_support()),
    "sgl_kernel_ops": sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                             if n.startswith("sgl_kernel::")),
}))
"""


@cache
def venv_kernel() -> dict:
    """The venv's sgl_kernel (stand-in or a real build), what torch sees of the CPU there, and which
    path SGLang's layers take (cpu_has_amx_support: True = its AMX/AVX-512 kernels)."""
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    done = subprocess.run([sglang_python(), "-W", "ignore", "-c", _ASK], capture_output=True, text=True,
                          timeout=300, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
