"""Rollout engines (step 1 of the RL step) and the weight sync into them (step 7).

engine.py      the RolloutEngine protocol, SamplingParams, GenerationResult
sampling.py    temperature / top-k / top-p sampling in float64 (local engine)
local_engine.py  pure-torch HF engine on CPU (tests, tiny runs, debugging)
sglang_engine.py SGLang servers over HTTP (GPU runs); sglang is imported lazily
sglang_protocol.py what goes over the wire to SGLang: /generate bodies, weight payloads
controller.py  spreads prompts over engines, reassembles results in prompt order
weight_sync.py streams the trainer's HF-named tensors to the engines in bounded buckets
"""

from megatron_dapo.rollout.controller import EngineThroughput, RolloutController
from megatron_dapo.rollout.engine import EngineError, GenerationResult, RolloutEngine, SamplingParams
from megatron_dapo.rollout.weight_sync import WeightSyncStats, sync_weights

__all__ = [
    "EngineError",
    "EngineThroughput",
    "GenerationResult",
    "RolloutController",
    "RolloutEngine",
    "SamplingParams",
    "WeightSyncStats",
    "sync_weights",
]
