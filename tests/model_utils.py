"""Tiny random HF checkpoints (Qwen2, Llama) made with transformers, and their reference log-probs.

Shared by the model, actor and weight-sync tests. vocab_size=100 is deliberately not a
multiple of 128 so Megatron's vocab padding is exercised at every TP size.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 128,
}


def make_tiny_checkpoint(
    directory: str | Path,
    family: str = "qwen2",
    *,
    num_layers: int = 4,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save a randomly initialised tiny HF model (config.json + model.safetensors).

    Weights are drawn N(0, 0.2), biases and norm weights included, so that a mapping
    error (a swapped q/k, a transposed shard) changes the logits visibly.

    Args:
        directory: where to save (created).
        family: "qwen2" or "llama".
        num_layers: num_hidden_layers.
        tie_word_embeddings: share lm_head with the embeddings.
        seed: torch seed for the weights.
        dtype: stored dtype.

    Returns:
        The directory.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[family]
    config = config_cls(
        **TINY_SHAPE, num_hidden_layers=num_layers, tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-5
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.to(dtype).save_pretrained(str(directory))
    return Path(directory)


def hf_log_probs(directory: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax of transformers' own logits for ``tokens`` (fp32, eager attention).

    Args:
        directory: HF checkpoint.
        tokens: [B, S] token ids.

    Returns:
        [B, S, V] log-probabilities.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return torch.log_softmax(logits.float(), dim=-1)
