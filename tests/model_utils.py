"""Tiny random HF checkpoints (Qwen2, Llama, Qwen3, Qwen3-MoE) made with transformers, and their reference log-probs.

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

TINY_MOE_SHAPE = {
    # 4 experts of width 32, top-2, renormalised; layer 1 dense (mlp_only_layers) so a
    # model mixes sparse and dense MLPs; head_dim 32 != hidden / heads, as in Qwen3.
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
    "head_dim": 32,
}


def make_tiny_checkpoint(
    directory: str | Path,
    family: str = "qwen2",
    *,
    num_layers: int = 4,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    moe: dict | None = None,
    shape: dict | None = None,
) -> Path:
    """Save a randomly initialised tiny HF model (config.json + model.safetensors).

    Weights are drawn N(0, 0.2), biases and norm weights included, so that a mapping
    error (a swapped q/k, a transposed shard) changes the logits visibly.

    Args:
        directory: where to save (created).
        family: "qwen2", "llama", "qwen3" or "qwen3_moe".
        num_layers: num_hidden_layers.
        tie_word_embeddings: share lm_head with the embeddings.
        seed: torch seed for the weights.
        dtype: stored dtype.
        moe: Qwen3-MoE config fields over TINY_MOE_SHAPE (qwen3_moe only).
        shape: config fields over TINY_SHAPE (e.g. a hidden size an engine's kernels need).

    Returns:
        The directory.
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }[family]
    extra = dict(TINY_MOE_SHAPE, **(moe or {})) if family == "qwen3_moe" else {}
    config = config_cls(
        **dict(TINY_SHAPE, **(shape or {})), num_hidden_layers=num_layers, tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-5,
        **extra,
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


def reference_log_probs(checkpoint: str | Path, prompt: list[int], output: list[int],
                        temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[token] of each output token from transformers in float32."""
    logp = hf_log_probs(checkpoint, torch.tensor([prompt + output]))[0]
    scaled = torch.log_softmax(logp / temperature, dim=-1) if temperature not in (0.0, 1.0) else logp
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return scaled[positions, torch.tensor(output)]


def sampled_gaps(checkpoint: str | Path, prompts: list[list[int]], results: list, temperature: float) -> torch.Tensor:
    """|engine - transformers| of every sampled token's log-prob (GenerationResults of `prompts`)."""
    return torch.cat([(torch.tensor(r.logprobs) - reference_log_probs(checkpoint, prompts[r.prompt_index],
                                                                     r.output_ids, temperature)).abs()
                      for r in results])


SERVER_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
"""The tiny Qwen3-MoE the server tiers serve (3 layers, hidden 128; dense layers as TINY_MOE_SHAPE has them)."""


def make_server_moe(directory: str | Path, seed: int, **moe: object) -> Path:
    """A SERVER_MOE checkpoint (fields in `moe` override it)."""
    return make_tiny_checkpoint(directory, "qwen3_moe", num_layers=3, moe={**SERVER_MOE, **moe},
                                shape={"hidden_size": 128}, seed=seed)


def with_experts_of(base: str | Path, donor: str | Path, directory: str | Path) -> Path:
    """A checkpoint with `base`'s weights but `donor`'s experts (what an update of the experts alone serves).

    Args:
        base: Qwen3-MoE checkpoint whose config and non-expert tensors are kept.
        donor: checkpoint of the same config whose ``mlp.experts.*`` tensors are taken.
        directory: where to save (created).

    Returns:
        The directory.
    """
    from safetensors.torch import load_file, save_file

    out = Path(directory)
    out.mkdir(parents=True)
    (out / "config.json").write_text((Path(base) / "config.json").read_text())
    kept, taken = (load_file(str(Path(p) / "model.safetensors")) for p in (base, donor))
    save_file({n: (taken[n] if ".mlp.experts." in n else t) for n, t in kept.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out
