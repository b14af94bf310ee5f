"""The subset of an HF config.json that a Llama-style decoder needs, parsed and checked.

Parsing reads the JSON directly (no transformers import: it costs seconds per rank) and
accepts both the transformers<5 spelling (``rope_theta``, ``rope_scaling``) and the >=5 one
(``rope_parameters``). Anything the Megatron model would silently compute differently
(rope scaling, sliding windows, other activations, o_proj/MLP biases) is refused here,
all problems in one message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_dapo.errors import UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class HFModelConfig:
    """Architecture hyper-parameters read from config.json."""

    family: str
    """Adapter family: a key of models.ADAPTERS ("qwen2", "llama", "qwen3", "qwen3_moe")."""
    architecture: str
    """HF architecture class name, e.g. "Qwen2ForCausalLM"."""
    vocab_size: int
    """Real (unpadded) vocabulary size V."""
    hidden_size: int
    """H."""
    intermediate_size: int
    """MLP width F."""
    num_layers: int
    """num_hidden_layers."""
    num_attention_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (query groups)."""
    head_dim: int
    """Per-head channels d."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    rope_theta: float
    """Rotary base."""
    max_position_embeddings: int
    """Longest sequence the rotary tables are sized for."""
    tie_word_embeddings: bool
    """Whether lm_head shares the embedding matrix."""
    qkv_bias: bool
    """Whether q/k/v projections have biases (Qwen2: yes)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3's q_norm / k_norm)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """SwiGLU width of one expert."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing probabilities to sum to 1 (else the full softmax's values)."""
    moe_layers: tuple[int, ...] = ()
    """0-based indices of the layers whose MLP is a mixture of experts; the others are dense
    (intermediate_size), from decoder_sparse_step and mlp_only_layers."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise UserError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads} in config.json; the config is corrupt"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UserError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}] "
                "in config.json; the config is corrupt"
            )

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return self.num_experts > 0 and bool(self.moe_layers)


def parse_decoder_config(
    raw: dict[str, Any], source: str, *, family: str, qkv_bias: bool, problems: list[str], **extra: Any
) -> HFModelConfig:
    """Build an HFModelConfig from config.json fields shared by Llama-style decoders.

    Args:
        raw: config.json as a dict.
        source: where it came from (for messages).
        family: adapter family name.
        qkv_bias: whether the family has q/k/v biases.
        problems: unsupported features found by the family parser; extended here.
        **extra: family fields of HFModelConfig (qk_norm, the MoE shape).

    Returns:
        The parsed config; raises ValueError listing every problem instead.
    """
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )
    missing = [key for key in required if key not in raw]
    if missing:
        raise UserError(f"{source} lacks required keys {missing}; it is not a complete decoder config.json")
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={raw['hidden_act']!r} (only 'silu' is supported)")
    rope = raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        problems.append(f"rope_parameters.rope_type={rope_type!r} (only unscaled rope is supported)")
    scaling = raw.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        problems.append(f"rope_scaling={scaling} (only unscaled rope is supported)")
    num_heads = raw["num_attention_heads"]
    architectures = raw.get("architectures") or [""]
    if problems:
        raise UserError(
            f"{source} describes a model this adapter cannot reproduce exactly: " + "; ".join(problems)
        )
    return HFModelConfig(
        family=family,
        architecture=architectures[0],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        **extra,
    )
