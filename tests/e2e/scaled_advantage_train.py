"""The trainer with every advantage multiplied by $TEST_ADVANTAGE_SCALE (-1: a flipped policy
gradient, 0: none): the faults the learning check (test_learning.py) must not pass.

Run as `python scaled_advantage_train.py CONFIG [overrides]`, like `python -m megatron_dapo.train`.
"""

import os
import sys

from megatron_dapo import train
from megatron_dapo.collect import batch

SCALE = float(os.environ["TEST_ADVANTAGE_SCALE"])
_assign = batch.assign_advantages


def scaled_assign_advantages(groups, norm_by_std):
    _assign(groups, norm_by_std)
    for g in groups:
        for s in g.samples:
            s.advantage *= SCALE


if __name__ == "__main__":
    batch.assign_advantages = scaled_assign_advantages
    sys.exit(train.main())
