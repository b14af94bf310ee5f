"""megatron-dapo's stand-in for SGLang's CPU kernel package (``sgl_kernel``), for sglang 0.5.18.

Installed into the SGLang CPU venv by scripts/install_sglang_cpu.sh unless a real CPU kernel
wheel is given (SGLANG_CPU_KERNEL_WHEEL). PyPI serves no CPU build of SGLang's kernels, and
the one built from source needs AVX-512 at run time, so this module is what lets SGLang's own
server run on every x86-64 CPU (AVX2 included) from the repository alone. docs/DESIGN.md,
"SGLang's CPU kernels", has the rule; tests/sglang_cpu/test_sglang_kernel_path.py pins it.

How SGLang 0.5.18 uses ``sgl_kernel`` on CPU (read in its wheel):
- ``srt/utils/common.cpu_has_amx_support()`` is ``torch.cpu._is_amx_tile_supported() and
  hasattr(torch.ops.sgl_kernel, "convert_weight_packed")``. Every AMX/AVX-512 kernel call of the
  layers (norms, activations, rotary, linear packing, fused MoE, top-k, KV store) is gated on
  it. This module registers no ``torch.ops.sgl_kernel`` op, so SGLang takes its torch paths on
  every CPU, AMX machines included (where the install says so).
- A few modules import names at import time under ``is_cpu()`` whatever the CPU; they serve
  speculative decoding (``assign_req_to_token_pool_cpu`` too: mem_cache/allocation.py calls it
  from ``alloc_for_spec_decode`` only) and KV moves, which our launch lines never enable. Here
  they are stubs that raise a clear error if called: prefill and decode call none of them
  (tests/sglang_cpu/test_sglang_server.py traces it).

Names SGLang probes with try/except (``sgl_kernel.allreduce``, ``sgl_kernel.quantization``, ...)
are absent on purpose, so those probes take their fallbacks. Set MEGATRON_DAPO_SGL_KERNEL_TRACE
to a file path to append one line per call of a function here (the tests read it).
"""

from __future__ import annotations

import os

__version__ = "0.4.6.post1"
MEGATRON_DAPO_STANDIN = True
"""Marks this module as the stand-in (the real package has no such name)."""


def _trace(name: str) -> None:
    path = os.environ.get("MEGATRON_DAPO_SGL_KERNEL_TRACE")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{name}\n")


def _not_built(name: str):
    def kernel(*args, **kwargs):
        _trace(name)
        raise RuntimeError(
            f"sgl_kernel.{name} was called, but this SGLang venv has megatron-dapo's stand-in for "
            "SGLang's CPU kernels (scripts/sglang_cpu/site/sgl_kernel), which serves plain decoding only "
            "(no speculative decoding, no KV moves); install a real CPU kernel build with "
            "SGLANG_CPU_KERNEL_WHEEL=<wheel> make install-sglang-cpu"
        )

    kernel.__name__ = name
    kernel.__qualname__ = name
    return kernel


# Imported at import time under is_cpu() by sglang 0.5.18, called only by speculative decoding
# (mem_cache/allocation.alloc_for_spec_decode, spec_utils, eagle_utils, eagle_worker_common,
# kernels/ops/speculative) or by KV moves that plain decoding does not make (kernels/ops/kvcache).
_SPECULATIVE_OR_KV_MOVE = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)
for _name in _SPECULATIVE_OR_KV_MOVE:
    globals()[_name] = _not_built(_name)
del _name

__all__ = list(_SPECULATIVE_OR_KV_MOVE)
