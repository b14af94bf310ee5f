"""megatron-dapo: DAPO reinforcement learning on a Megatron-Core actor with SGLang rollouts."""

__version__ = "0.1.0"
