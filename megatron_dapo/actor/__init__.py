"""The Megatron actor: log-probs and entropy from vocab-parallel logits, micro-batching, train step."""
