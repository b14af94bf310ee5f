#!/usr/bin/env python3
"""Plan memory, fit and step time of an experiment before launching it (see megatron_dapo/plan/).

    python tools/plan.py examples/dapo_qwen2.5_32b.yaml --nodes 16 --gpus-per-node 8 --gpu-mem-gib 80
"""

import sys
from pathlib import Path

# Runs from a checkout without `pip install -e .` too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dapo.plan import main

if __name__ == "__main__":
    sys.exit(main())
