"""megatron-dapo: DAPO reinforcement learning on a Megatron-Core actor with SGLang rollouts."""

__version__ = "0.1.0"

from megatron_dapo.lifetime import die_with_parent, started_by_multiprocessing

# A spawn child (megatron-core's checkpoint Manager, a reward worker) re-imports the
# trainer's main module and so this package: tie its life to the trainer's (lifetime.py).
if started_by_multiprocessing():
    die_with_parent()
