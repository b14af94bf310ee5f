"""The local engine: transformers' model with continuous batching, in-process or in its own process.

engine.py   LocalEngine (CPU tests, the tiny runs, debugging; the warm start's check)
decoder.py  the continuous-batching decode loop; kv_rows.py its preallocated KV buffers
attention.py torch SDPA over grouped KV heads (CPU); sampling.py float64 top-k/top-p sampling
process.py  ProcessEngine: the same engine in a child process (rollout.placement=disaggregated)
"""
