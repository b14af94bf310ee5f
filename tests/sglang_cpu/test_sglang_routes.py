"""Why the SGLang engine reports no routed experts on a CPU (issue 26), pinned in sglang 0.5.18's source.

SGLang 0.5.18 can return them: ``--enable-return-routed-experts`` and a request's
``return_routed_experts`` put base64 int32 bytes [tokens, num_hidden_layers, k] in
``meta_info["routed_experts"]``. Its capturer's host buffer is allocated with
``pin_memory=True`` (state_capturer/base.py, BaseHostCache), which a machine without an
accelerator refuses: the CPU server launched with the flag died at start with
"pin_memory=True requires a CUDA or other accelerator backend" (2026-11-25). The pin fails
when a release drops that; then the client can parse the routes and config/experiment.py can
allow routing_replay=rollout with SGLang.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megatron_dapo.rollout.sglang.server import sglang_python

pytestmark = [
    pytest.mark.sglang_cpu,
    pytest.mark.skipif(sglang_python() is None, reason="SGLang is not installed (make install-sglang-cpu)"),
]


def test_the_routed_experts_capturer_pins_host_memory():
    origin = subprocess.run([sglang_python(), "-c", "import importlib.util; print(importlib.util.find_spec('sglang').origin)"],
                            capture_output=True, text=True, check=True).stdout.strip()
    root = Path(origin).parent / "srt"
    base = (root / "state_capturer" / "base.py").read_text()
    host_cache = base[base.index("class BaseHostCache"):]
    assert "pin_memory=True" in host_cache.split("def ", 2)[1]  # its __init__
    assert "enable_return_routed_experts" in (root / "server_args.py").read_text()
    assert 'meta_info["routed_experts"]' in (root / "managers" / "tokenizer_manager.py").read_text()
