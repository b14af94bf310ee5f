"""The CPU layer's shims are named, scoped, and never in place in a process that sees CUDA (device.py).

Every megatron-core test of this suite runs under them (DESIGN.md "Megatron-Core on CPU" lists what
each test therefore proves nothing about on CUDA). Held here: on CPU every shim is installed and
each named target is ours; in a CUDA-looking process (torch.cuda.is_available() true, no GPU
touched) setup_device installs none and megatron-core's functions are its own; and a process that
installed them and then sees CUDA is refused. Each case runs in a process of its own (the layer is
process-wide).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def _run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_CUDA_LOOKING = """
    import torch
    torch.cuda.is_available = lambda: True      # a GPU node, as far as setup_device can tell
    torch.cuda.set_device = lambda index: None  # nothing of CUDA is touched
"""


def test_on_cpu_every_shim_is_in_place_and_a_cuda_device_is_then_refused() -> None:
    out = _run("""
        import json
        import torch
        import megatron.core.transformer.moe.token_dispatcher  # noqa: F401  (the MoE shims' modules)
        from megatron_dapo import device
        device.setup_device("cpu")
        marked = {}
        for shim in device.CPU_SHIMS:
            for target in shim.targets:
                if "<" not in target:
                    marked[target] = getattr(device._resolve(target), device._SHIM_MARK, False)
        torch.cuda.is_available = lambda: True  # the same process then sees CUDA
        try:
            device.setup_device("auto")
            error = None
        except RuntimeError as err:
            error = str(err)
        print(json.dumps({"active": device.active_shims(), "names": [s.name for s in device.CPU_SHIMS],
                          "marked": marked, "read_in": [s.read_in for s in device.CPU_SHIMS], "error": error}))
    """)
    assert out["active"] == out["names"] and len(out["names"]) == 6
    first = {t for t in out["marked"] if not t.startswith("torch.cuda:") or t == "torch.cuda:current_device"}
    assert all(out["marked"][t] for t in first), {t: out["marked"][t] for t in first}
    assert all("megatron-core" in r or "torch" in r for r in out["read_in"])
    assert out["error"] is not None and "the CPU layer is installed in a process that sees CUDA" in out["error"]
    assert "torch.cuda entry points" in out["error"]


def test_a_cuda_looking_process_runs_megatrons_own_path() -> None:
    out = _run(textwrap.dedent(_CUDA_LOOKING) + textwrap.dedent("""
        import json
        import megatron.core.transformer.moe.token_dispatcher  # noqa: F401
        from megatron.core.tensor_parallel import mappings, random
        from megatron_dapo import device
        dev = device.setup_device("auto")
        print(json.dumps({"device": str(dev), "active": device.active_shims(), "layer": device.cpu_layer_active(),
                          "gather_is_megatrons": mappings._gather_along_first_dim.__module__ == mappings.__name__,
                          "rng_is_megatrons": random._get_cuda_rng_state.__module__ == random.__name__}))
    """))
    assert out == {"device": "cuda:0", "active": [], "layer": False, "gather_is_megatrons": True,
                   "rng_is_megatrons": True}
