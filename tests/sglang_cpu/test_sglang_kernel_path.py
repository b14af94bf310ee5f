"""Which code path SGLang's CPU server takes on this CPU, and that the install chose it on purpose.

docs/DESIGN.md, "SGLang's CPU kernels": by default the venv holds megatron-dapo's sgl_kernel
stand-in, with which SGLang 0.5.18 takes its torch paths on every x86-64 CPU (AVX2, AVX-512 and
AMX machines alike); a real kernel build runs only where it was given and this CPU can execute
it, and then SGLang's AMX path follows the CPU. These tests read the venv's own interpreter, so
they hold on whichever CPU CI got (.ci/run prints its instruction sets first).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from proc_utils import cpu_flags
from sglang_venv import venv_kernel
from tiers import requires, sglang_missing

pytestmark = [
    pytest.mark.sglang_cpu,
    *requires(sglang_missing()),
]

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "scripts" / "install_sglang_cpu.sh"




def test_sglang_takes_the_path_of_the_kernel_the_venv_holds():
    kernel = venv_kernel()
    flags = cpu_flags()
    # torch's AMX probe (SGLang's first condition) agrees with the CPU's own flags.
    assert kernel["torch_amx_tile"] == ("amx_tile" in flags), (kernel, sorted(f for f in flags if "amx" in f))
    if kernel["standin"]:
        # No torch.ops.sgl_kernel op is registered, so cpu_has_amx_support() is False even on AMX:
        # norms, activations, rotary, linear, MoE, KV store and sampling all take torch's code.
        assert kernel["sgl_kernel_ops"] == []
        assert kernel["sglang_amx_path"] is False
        assert Path(kernel["kernel_file"]).read_bytes() == (
            REPO / "scripts/sglang_cpu/site/sgl_kernel/__init__.py").read_bytes(), "stale stand-in: rerun the install"
    else:
        # A real build: its AMX kernels run exactly where the CPU has AMX.
        assert "convert_weight_packed" in kernel["sgl_kernel_ops"]
        assert kernel["sglang_amx_path"] == kernel["torch_amx_tile"]


def test_torch_in_the_venv_runs_the_kernel_level_of_this_cpu():
    """torch dispatches its own CPU kernels by the CPU (ATen's cpu capability): AVX512 needs
    AVX-512 F/BW/VL/DQ, else AVX2 with FMA. The same torch build serves both kinds of CPU."""
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip("ATEN_CPU_CAPABILITY overrides the CPU's own level")
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        expected = "AVX512"
    elif {"avx2", "fma"} <= flags:
        expected = "AVX2"
    else:
        expected = "DEFAULT"
    assert venv_kernel()["torch_cpu_capability"] == expected


def test_the_install_says_when_it_leaves_amx_kernels_unused(tmp_path):
    """On an AMX CPU the stand-in means SGLang's AMX kernels do not run: the install says so and how
    to get them. On a CPU without AMX it says nothing of the kind (nothing is lost there)."""
    if not venv_kernel()["standin"]:
        pytest.skip("this SGLang venv has a real sgl_kernel build")
    outputs = {}
    for name, extra in (("amx", " amx_tile amx_bf16 amx_int8"), ("zen3", "")):
        cpuinfo = tmp_path / f"{name}.cpuinfo"
        cpuinfo.write_text("model name\t: test\nflags\t\t: fpu sse sse2 avx avx2 fma" + extra + "\n")
        env = {**os.environ, "MEGATRON_DAPO_CPUINFO": str(cpuinfo)}  # the install's decision only
        env.pop("SGLANG_CPU_KERNEL_WHEEL", None)
        done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs[name] = done.stdout + done.stderr
    assert "ready for rollout.engine=sglang" in outputs["amx"]
    assert "this CPU has AMX" in outputs["amx"] and "SGLANG_CPU_KERNEL_WHEEL=<wheel>" in outputs["amx"]
    assert "sgl_kernel: megatron-dapo's stand-in; SGLang runs torch paths" in outputs["zen3"]
    assert "AMX" not in outputs["zen3"]
