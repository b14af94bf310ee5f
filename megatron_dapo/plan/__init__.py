"""The planner: will an experiment fit, and how long will a step take (`megatron-dapo plan`).

model.py is the memory and step-time model (every formula next to its number);
report.py lays out the ranks, formats the table and parses the command line.
"""

from megatron_dapo.plan.model import (
    EMBEDDED_VOCAB_SIZE,
    GIB,
    GPUS,
    MODEL_CONFIG_DIR,
    Assumptions,
    Hardware,
    Line,
    ModelDims,
    Plan,
    activation_bytes_per_token_layer,
    known_model_configs,
    kv_bytes_per_token,
    make_plan,
    model_state_bytes_per_param,
    padded_vocab_size,
    params_per_gpu,
    resolve_model,
)
from megatron_dapo.plan.report import (
    build_parser,
    format_layout,
    format_plan,
    main,
    rank_coords,
    rank_groups,
    run,
)

__all__ = [
    "EMBEDDED_VOCAB_SIZE",
    "GIB",
    "GPUS",
    "MODEL_CONFIG_DIR",
    "Assumptions",
    "Hardware",
    "Line",
    "ModelDims",
    "Plan",
    "activation_bytes_per_token_layer",
    "build_parser",
    "format_layout",
    "format_plan",
    "known_model_configs",
    "kv_bytes_per_token",
    "main",
    "make_plan",
    "model_state_bytes_per_param",
    "padded_vocab_size",
    "params_per_gpu",
    "rank_coords",
    "rank_groups",
    "resolve_model",
    "run",
]
