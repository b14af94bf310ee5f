#!/usr/bin/env bash
# The GPU checks, run from the repo root on a CUDA machine (the lent device, or a cluster
# node): `bash scripts/gpu_check.sh [tests|bench|train|all]`. Logs and JSON go to $OUT
# (default runs/gpu_check). Wheels under .whl/ (e.g. megatron-core for a machine without
# a package index) are installed to /tmp/site first. docs/benchmarks.md records results.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia_smi.csv"
python3 -c "import torch, triton, transformers, megatron.core as m; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'megatron-core', m.__version__)" | tee "$OUT/versions.txt"

if [[ $what == tests || $what == all ]]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [[ $what == bench || $what == all ]]; then
  timeout 240 python3 benchmarks/logprob_gpu.py --json "$OUT/logprob_gpu.json" 2>&1 | tee "$OUT/logprob_gpu.log"
  timeout 300 python3 benchmarks/update_step_gpu.py --json "$OUT/update_step_gpu.json" 2>&1 | tee "$OUT/update_step_gpu.log"
fi
if [[ $what == update512 ]]; then  # the same budget in shorter sequences (unfused attention is O(S^2))
  timeout 300 python3 benchmarks/update_step_gpu.py --seq-len 512 --json "$OUT/update_step_gpu_512.json" 2>&1 | tee "$OUT/update_step_gpu_512.log"
fi
if [[ $what == train || $what == all ]]; then
  rm -rf runs/tiny_gpu
  run=(python3 -m megatron_dapo.train examples/tiny_gpu.yaml "${@:2}")
  timeout 420 "${run[@]}" trainer.total_training_steps=20 2>&1 | tee "$OUT/tiny_gpu.log"
  # Resume: the same run extended by 5 steps continues from the step-20 checkpoint.
  timeout 150 "${run[@]}" trainer.total_training_steps=25 2>&1 | tee "$OUT/tiny_gpu_resume.log"
  cp runs/tiny_gpu/metrics.jsonl "$OUT/tiny_gpu_metrics.jsonl"
fi
