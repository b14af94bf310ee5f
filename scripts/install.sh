#!/usr/bin/env bash
# Installs megatron-dapo and what it needs into the current Python, idempotently.
# On a machine without a GPU it never pulls a CUDA build of torch: torch is installed
# first, as the CPU build, so the package's own `torch` requirement is already met.
# Without a GPU every package comes at the version in constraints/cpu.txt (the tested
# environment of the documented numbers); MEGATRON_DAPO_CONSTRAINTS=none skips that,
# another path uses that file instead. GPU machines keep their image's versions.
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."

CONSTRAINTS=()
if command -v nvidia-smi >/dev/null 2>&1; then
  : "${MEGATRON_DAPO_CONSTRAINTS:=none}"
fi
case "${MEGATRON_DAPO_CONSTRAINTS:-constraints/cpu.txt}" in
  none) ;;
  *) CONSTRAINTS=(-c "${MEGATRON_DAPO_CONSTRAINTS:-constraints/cpu.txt}") ;;
esac

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install "torch>=2.4,<2.15"
  elif "$PY" -m pip download --no-deps -q -d /tmp/.torch-probe "torch==2.13.0+cpu" >/dev/null 2>&1 \
       || ls /opt/wheels/torch-2.13.0+cpu-* >/dev/null 2>&1; then
    "$PY" -m pip install "torch==2.13.0"
  else
    "$PY" -m pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# Idempotent and quick when everything is there; also picks up new requirements and
# moves packages to the constrained versions.
# [docs]: the suite builds the user guide strictly (tests/unit/test_docs_build.py).
"$PY" -m pip install -q ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} -e ".[test,docs]"
# tests/unit/test_algo_loss_modes.py holds each policy-loss mode equal to verl's own function:
# verl's source only (tests/unit/verl_core_algos.py loads two of its files), not its dependencies.
"$PY" -m pip install -q --no-deps "verl==0.9.1"
