"""Rollout engines (step 1 of the RL step) and the weight sync into them (step 7).

The shared core, here:
engine.py         the RolloutEngine protocol, SamplingParams, GenerationResult, EngineError
controller.py     spreads prompts over engines, reassembles results in prompt order
controller_sync.py its weight updates, failures and restarts (one restart per death)
streaming.py      the prompt feed and per-prompt streaming of servers (dynamic sampling)
weight_sync.py    streams the trainer's HF-named tensors to the engines in bounded buckets
flat_bucket.py    one flat buffer per dtype per bucket (SGLang's format; the local process engine's)
server_process.py launching and watching an inference server process (SGLang, vLLM)
placement.py      which ranks of which node each engine takes
factory.py        engine name -> engines, for training, evaluation and the warm-start check

One folder per engine family: local/ (pure-torch HF engine: CPU, tests, tiny runs; also
in its own process), sglang/ (SGLang servers over HTTP, colocated on the actor's GPUs),
vllm/ (one vLLM server). A new engine is a folder, a FAMILIES entry in factory.py and its
name in config.rollout.EngineName.
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
