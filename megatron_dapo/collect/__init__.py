"""The controller's half of an RL step (DESIGN.md steps 1-4), on global rank 0 only.

    1. draw prompts, generate `n` responses each (token ids in and out)
    2. score every response (reward pool with per-call timeouts) + overlong shaping
    3. dynamic sampling: keep groups whose metric has spread until `train_batch_size`
       groups are kept (streaming.py, the default, or verl's rounds, rounds.py)
    4. group-relative advantages over the shaped rewards

Modules: types.py (Sample, Group, CollectSettings), scoring.py (generate, score, shape,
advantages, metrics), rounds.py, streaming.py, carry.py (what a step hands the next:
partial rollouts, the keep rate), batch.py (`collect_batch`, the trainer's entry),
producer.py (the asynchronous loop's producer thread), heldout.py (validation during
training), trained.py (the tests' record of every trained sample).
"""

from megatron_dapo.collect.batch import collect_batch
from megatron_dapo.collect.carry import CarriedGroup, CollectState
from megatron_dapo.collect.heldout import score_heldout, val_sampling_params
from megatron_dapo.collect.types import CollectSettings, Group, Sample

__all__ = ["CarriedGroup", "CollectSettings", "CollectState", "Group", "Sample", "collect_batch", "score_heldout",
           "val_sampling_params"]
