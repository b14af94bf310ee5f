"""The planner: will an experiment fit, and how long will a step take (`megatron-dapo plan`).

dims.py reads the model's shape (dense or mixture-of-experts) from its config.json;
model.py is the memory and step-time model (every formula next to its number);
search.py plans every layout of the machine and ranks those that fit;
fleet.py plans the cluster split between the actor and a fleet of engines (--engine-nodes);
report.py lays out the ranks, formats the table and parses the command line.
"""

from megatron_dapo.plan.dims import (
    EMBEDDED_VOCAB_SIZE,
    MODEL_CONFIG_DIR,
    ModelDims,
    known_model_configs,
    resolve_model,
)
from megatron_dapo.plan.fleet import FleetPlan, SyncLink, check_fleet, make_fleet_plan, stage_sync_bytes
from megatron_dapo.plan.model import (
    GIB,
    GPUS,
    Assumptions,
    Hardware,
    Line,
    Plan,
    StageParams,
    activation_bytes_per_token_layer,
    check_expert_layout,
    experts_touched,
    generation_line,
    in_flight,
    kv_bytes_per_token,
    make_plan,
    mean_lengths,
    model_state_bytes_per_param,
    padded_vocab_size,
    params_per_gpu,
    stage_params,
)
from megatron_dapo.plan.report import (
    build_parser,
    expert_rank_coords,
    format_fleet,
    format_layout,
    format_plan,
    main,
    rank_coords,
    rank_groups,
    run,
)
from megatron_dapo.plan.search import Candidate, candidate_layouts, format_search, search_layouts

__all__ = [
    "EMBEDDED_VOCAB_SIZE",
    "GIB",
    "GPUS",
    "MODEL_CONFIG_DIR",
    "Assumptions",
    "Candidate",
    "FleetPlan",
    "Hardware",
    "Line",
    "ModelDims",
    "Plan",
    "StageParams",
    "SyncLink",
    "activation_bytes_per_token_layer",
    "build_parser",
    "candidate_layouts",
    "check_expert_layout",
    "check_fleet",
    "expert_rank_coords",
    "experts_touched",
    "format_fleet",
    "format_layout",
    "format_plan",
    "format_search",
    "generation_line",
    "in_flight",
    "known_model_configs",
    "kv_bytes_per_token",
    "main",
    "make_fleet_plan",
    "make_plan",
    "mean_lengths",
    "model_state_bytes_per_param",
    "padded_vocab_size",
    "params_per_gpu",
    "rank_coords",
    "rank_groups",
    "resolve_model",
    "run",
    "search_layouts",
    "stage_params",
    "stage_sync_bytes",
]
