"""megatron-dapo: DAPO reinforcement learning on a Megatron-Core actor with SGLang rollouts."""

__version__ = "0.1.0"

from megatron_dapo.lifetime import die_with_parent, started_by_multiprocessing

# A spawn child (megatron-core's checkpoint Manager, a reward worker) re-imports the
# trainer's main module and so this package: tie its life to the trainer's (lifetime.py).
if started_by_multiprocessing():
    die_with_parent()

# megatron-core warns on import, on every CPU machine, that Transformer Engine and Apex are
# missing: noise before the one line a tool or the trainer prints (errors.py has the filter).
from megatron_dapo.errors import quiet_optional_backend_warnings

quiet_optional_backend_warnings()
