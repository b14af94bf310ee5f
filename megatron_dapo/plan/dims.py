"""The shape of the model being planned: what memory and FLOPs depend on, read from an HF config.json.

Dense Qwen2/Llama/Qwen3 and mixture-of-experts Qwen3-MoE (and Qwen2-MoE-style shared
experts) in one record. Parameters are counted by where megatron-core keeps them on a GPU,
because that decides how they are sharded: attention and MLP matrices split over TP,
norms and the router replicated on every TP rank, routed experts split over EP x ETP
(model.py turns these into per-GPU bytes). The planner reads config.json itself rather
than through models/ (whose adapters refuse what the actor cannot train): planning a
model before it is supported is allowed, and costs no transformers or torch import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.config import Config, ConfigError

MODEL_CONFIG_DIR = Path(__file__).resolve().parents[2] / "examples" / "model_configs"
EMBEDDED_VOCAB_SIZE = 512
"""Vocabulary of the embedded task's tokenizer (its upper bound), used for a scratch model."""
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
"""model_type values with an RMSNorm over each query and key head (no config key says so)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelDims:
    """The shape facts of a decoder-only model that memory and FLOPs depend on."""

    name: str
    """Display name."""
    source: str
    """Where the dims came from (a config.json path, or model.scratch)."""
    hidden_size: int
    """h."""
    intermediate_size: int
    """F, the SwiGLU width of a dense layer (gate and up projections are both h x F)."""
    num_layers: int
    """L."""
    num_attention_heads: int
    """a, query heads."""
    num_key_value_heads: int
    """KV heads (GQA groups)."""
    head_dim: int
    """d, per-head width."""
    vocab_size: int
    """V before Megatron's padding."""
    tie_word_embeddings: bool
    """Output layer shares the embedding matrix."""
    qkv_bias: bool
    """Q/K/V projections have biases (Qwen2 does)."""
    qk_norm: bool = False
    """RMSNorm (width d) over every query and key head (Qwen3)."""
    num_experts: int = 0
    """E, routed experts per MoE layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """k, experts each token is routed to."""
    moe_intermediate_size: int = 0
    """F_moe, the SwiGLU width of one routed expert."""
    shared_expert_intermediate_size: int = 0
    """F_s, the SwiGLU width of an always-on shared expert (Qwen2-MoE); 0 = none."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by a sigmoid gate (an h-wide vector)."""
    moe_layers: tuple[int, ...] = ()
    """0-based indices of the layers whose MLP is a mixture of experts (the others are dense)."""

    @classmethod
    def from_hf(cls, hf: dict, name: str, source: str) -> ModelDims:
        """Read an HF config.json dict (Qwen2/Llama/Qwen3 keys, and Qwen3-MoE's expert keys).

        A layer i is sparse when num_experts > 0, i is not in mlp_only_layers and
        (i + 1) % decoder_sparse_step == 0 (transformers' Qwen3MoeDecoderLayer).
        """
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            layers = int(hf["num_hidden_layers"])
            model_type = hf.get("model_type", "")
            experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
            moe: dict = {}
            if experts:
                step = int(hf.get("decoder_sparse_step") or 1)
                dense_only = set(hf.get("mlp_only_layers") or [])
                shared = int(hf.get("shared_expert_intermediate_size") or 0)
                moe = {
                    "num_experts": experts,
                    "num_experts_per_tok": int(hf["num_experts_per_tok"]),
                    "moe_intermediate_size": int(hf["moe_intermediate_size"]),
                    "shared_expert_intermediate_size": shared,
                    "shared_expert_gate": bool(shared) and model_type == "qwen2_moe",
                    "moe_layers": tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0),
                }
            dims = cls(
                name=name,
                source=source,
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                vocab_size=int(hf["vocab_size"]),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=bool(hf.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
                qk_norm=model_type in QK_NORM_FAMILIES,
                **moe,
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing key {e.args[0]!r}; give a complete HF config.json") from None
        if dims.num_experts and not 0 < dims.num_experts_per_tok <= dims.num_experts:
            raise ConfigError(f"{source}: num_experts_per_tok={dims.num_experts_per_tok} must be in "
                              f"[1, num_experts={dims.num_experts}]; the config is corrupt")
        return dims

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return self.num_experts > 0 and bool(self.moe_layers)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def q_dim(self) -> int:
        """Width of all query heads (a * d)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads."""
        return self.num_key_value_heads * self.head_dim

    def attention_params(self) -> int:
        """QKV (+ bias) and the output projection: the TP-sharded part of attention."""
        qkv = self.q_dim + 2 * self.kv_dim
        return self.hidden_size * qkv + (qkv if self.qkv_bias else 0) + self.q_dim * self.hidden_size

    def replicated_params(self, sparse: bool) -> int:
        """A layer's weights every TP rank holds whole: two RMSNorms (2h), QK-norm (2d), a
        sparse layer's router (E x h) and shared-expert gate (h)."""
        n = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        if sparse:
            n += self.num_experts * self.hidden_size + (self.hidden_size if self.shared_expert_gate else 0)
        return n

    def mlp_params(self, sparse: bool) -> int:
        """The TP-sharded MLP that is not a routed expert: a dense layer's SwiGLU (3hF), or a
        sparse layer's shared expert (3hF_s, 0 without one)."""
        width = self.shared_expert_intermediate_size if sparse else self.intermediate_size
        return 3 * self.hidden_size * width

    def expert_params(self) -> int:
        """One routed expert: gate, up and down projections, 3 x h x F_moe."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def layer_params(self, sparse: bool = False, experts: int | None = None) -> int:
        """Parameters of one transformer layer.

        Args:
            sparse: a mixture-of-experts layer (else a dense one).
            experts: routed experts to count (default all E; k for the active parameters).
        """
        routed = (self.num_experts if experts is None else experts) * self.expert_params() if sparse else 0
        return self.attention_params() + self.replicated_params(sparse) + self.mlp_params(sparse) + routed

    def embedding_params(self, vocab: int | None = None) -> int:
        """Input embedding plus output layer (one matrix when tied)."""
        v = self.vocab_size if vocab is None else vocab
        return v * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def num_params(self) -> int:
        """All parameters with the unpadded vocabulary (what the HF checkpoint holds)."""
        sparse = self.num_moe_layers
        return ((self.num_layers - sparse) * self.layer_params() + sparse * self.layer_params(sparse=True)
                + self.embedding_params() + self.hidden_size)

    def num_active_params(self) -> int:
        """Parameters one token passes through: attention, router, the top-k experts, embeddings.

        Equals num_params for a dense model. Training and decode FLOPs scale with this.
        """
        sparse = self.num_moe_layers
        active = self.layer_params(sparse=True, experts=self.num_experts_per_tok)
        return ((self.num_layers - sparse) * self.layer_params() + sparse * active
                + self.embedding_params() + self.hidden_size)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: cannot read the model config: {e}") from None


def known_model_configs(directory: Path = MODEL_CONFIG_DIR) -> dict[str, Path]:
    """Bundled config.json files by model name (file stem), e.g. 'Qwen2.5-32B'."""
    return {p.stem: p for p in sorted(directory.glob("*.json"))}


def resolve_model(cfg: Config, model_config: str | None = None, vocab_size: int = EMBEDDED_VOCAB_SIZE,
                  directory: Path = MODEL_CONFIG_DIR) -> ModelDims:
    """Find the model's dims: --model-config, else the checkpoint's config.json, else a bundled one.

    Args:
        cfg: the experiment.
        model_config: a bundled name (examples/model_configs/<name>.json) or a config.json path.
        vocab_size: vocabulary of a scratch model (model.hf_checkpoint null).
        directory: where bundled configs live.

    Returns:
        The dims, with `source` saying which file was used.

    Raises:
        ConfigError: unknown name, unreadable file, or no way to know the model.
    """
    known = known_model_configs(directory)
    if model_config is not None:
        path = Path(model_config)
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            return ModelDims.from_hf(_read_json(path), path.parent.name or path.stem, str(path))
        match = {k.lower(): v for k, v in known.items()}.get(model_config.lower())
        if match is None:
            raise ConfigError(f"--model-config={model_config!r}: neither a config.json nor a bundled model; "
                              f"use one of {', '.join(known)} or a path to config.json")
        return ModelDims.from_hf(_read_json(match), match.stem, str(match))
    ckpt = cfg.model.hf_checkpoint
    if ckpt is None:
        s = cfg.model.scratch
        moe = s.family == "qwen3_moe"  # the fields embedded.scratch_checkpoint writes
        experts = {"num_experts": s.num_experts, "num_experts_per_tok": s.num_experts_per_tok,
                   "moe_intermediate_size": s.moe_intermediate_size or max(1, s.intermediate_size // s.num_experts_per_tok),
                   "moe_layers": tuple(i for i in range(s.num_layers) if i not in s.mlp_only_layers)} if moe else {}
        return ModelDims(
            name="scratch", source="model.scratch", hidden_size=s.hidden_size,
            intermediate_size=s.intermediate_size, num_layers=s.num_layers,
            num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_key_value_heads,
            head_dim=s.hidden_size // s.num_attention_heads, vocab_size=vocab_size,
            tie_word_embeddings=s.tie_word_embeddings, qkv_bias=not moe, **experts,
        )
    own = Path(ckpt) / "config.json"
    if own.is_file():
        return ModelDims.from_hf(_read_json(own), Path(ckpt).name, str(own))
    base = Path(ckpt.rstrip("/")).name.lower()
    # Longest name first: "qwen2.5-32b-instruct" must pick Qwen2.5-32B, never a shorter prefix.
    for name in sorted(known, key=len, reverse=True):
        if name.lower() in base:
            return ModelDims.from_hf(_read_json(known[name]), name, f"{known[name]} (matched from {ckpt})")
    raise ConfigError(f"model.hf_checkpoint={ckpt!r}: no config.json there and the name matches no bundled "
                      f"model ({', '.join(known)}); pass --model-config NAME or a config.json path")


def teacher_dims(cfg: Config, warnings: list[str]) -> ModelDims | None:
    """The distillation teacher's dims from its config.json (algorithm.distill.teacher); None without one."""
    if cfg.algorithm.distill.teacher is None:
        return None
    path = Path(cfg.algorithm.distill.teacher) / "config.json"
    if not path.is_file():
        warnings.append(f"algorithm.distill.teacher: no {path}; the teacher's pass is not counted")
        return None
    return ModelDims.from_hf(_read_json(path), "teacher", str(path))
