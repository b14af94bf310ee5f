"""The `model` and `parallel` sections: which network, how it starts, how it is sharded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_dapo.config.fields import _check, _check_path


@dataclass(kw_only=True, slots=True)
class ScratchModelConfig:
    """A Qwen2-style model, or a Qwen3-MoE one, initialised from scratch (the embedded CPU run, tests)."""

    family: Literal["qwen2", "qwen3_moe"] = "qwen2"
    """qwen2: dense (the default run). qwen3_moe: Qwen3's attention (QK-norm) with a mixture of
    experts in every layer but mlp_only_layers (examples/tiny_moe_cpu.yaml)."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer layers; must divide by the pipeline size."""
    num_attention_heads: int = 4
    """Query heads; must divide by the tensor-parallel size."""
    num_key_value_heads: int = 2
    """Key/value heads (GQA query groups); must divide by the tensor-parallel size."""
    intermediate_size: int = 384
    """SwiGLU hidden width."""
    max_position_embeddings: int = 32768
    """Longest sequence (prompt + response) the rotary tables cover."""
    rope_theta: float = 10000.0
    """Rotary base."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the output layer, as small Qwen2 models do."""
    num_experts: int = 8
    """qwen3_moe: routed experts per MoE layer."""
    num_experts_per_tok: int = 2
    """qwen3_moe: experts each token goes to (top-k)."""
    moe_intermediate_size: int = 0
    """qwen3_moe: SwiGLU width of one expert; 0 = intermediate_size / num_experts_per_tok (the
    dense MLP's active width)."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """qwen3_moe: 0-based layers with a dense MLP (intermediate_size) instead of experts."""
    norm_topk_prob: bool = True
    """qwen3_moe: renormalise the top-k routing probabilities (Qwen3-30B-A3B does)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "max_position_embeddings"):
            _check(getattr(self, name) > 0, name, "must be a positive integer")
        if self.family == "qwen3_moe":
            _check(self.num_experts >= 2, "num_experts", "must be >= 2 for a mixture of experts")
            _check(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                   f"must be in [1, num_experts={self.num_experts}]")
            _check(self.moe_intermediate_size >= 0, "moe_intermediate_size", "must be >= 0 (0 = derived)")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
            _check(not bad, "mlp_only_layers", f"has {bad}, outside the layers [0, {self.num_layers})")
            _check(len(set(self.mlp_only_layers)) < self.num_layers, "mlp_only_layers",
                   "leaves no MoE layer; drop some, or use family: qwen2")
        _check(self.hidden_size % self.num_attention_heads == 0, "hidden_size",
               f"must be a multiple of num_attention_heads={self.num_attention_heads}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
               f"must divide num_attention_heads={self.num_attention_heads}")


@dataclass(kw_only=True, slots=True)
class SFTWarmStartConfig:
    """Supervised warm start of the scratch model on worked solutions (embedded run only)."""

    enable: bool = False
    """Run SFT before RL so the policy starts with non-trivial accuracy; the result is cached."""
    num_steps: int = 300
    """Optimizer steps of SFT."""
    batch_size: int = 32
    """Sequences per SFT step."""
    lr: float = 3e-3
    """Learning rate of SFT (10 warm-up steps, then constant)."""
    target_acc_min: float | None = None
    """Stop SFT at the first check whose held-out accuracy (as the trainer's val/acc: val files,
    rollout.val_kwargs; seed trainer.seed + 1, validation's is + 2) is in [target_acc_min, target_acc_max], so every
    machine starts RL from a comparable policy; num_steps is then the most steps. None = a fixed
    num_steps."""
    target_acc_max: float | None = None
    """Upper end of the band; a check above it stops SFT too, keeping the check nearest the band."""
    band_by_kind: bool = False
    """The band applies to the weakest problem kind's held-out accuracy (the prompts'
    extra_info.kind: the embedded task's add, sub, big_mul, ...) instead of the mean over all
    prompts: a task of two skills then starts RL with both half there, not one of them learnt and
    the other absent (the tool example, docs/benchmarks.md issue 63)."""
    check_interval: int = 50
    """SFT steps between held-out accuracy checks (with a target band)."""
    fine_check_interval: int | None = 10
    """Steps between checks once a check has read at least half of target_acc_min: accuracy can
    climb through the whole band between two coarse checks (0.26 -> 0.42 in 50 steps, seen on
    the embedded task), and RL would start from wherever it landed. None = check_interval; a
    value above check_interval acts as check_interval (a config with check_interval=5 keeps its
    checks every 5 steps under the default of 10)."""

    def __post_init__(self) -> None:
        _check(self.num_steps >= 0, "num_steps", "must be >= 0")
        _check(self.batch_size > 0, "batch_size", "must be > 0")
        _check(self.lr > 0, "lr", "must be > 0")
        _check(self.check_interval > 0, "check_interval", "must be > 0")
        _check(self.fine_check_interval is None or self.fine_check_interval > 0,
               "fine_check_interval", "must be > 0 (or null: check_interval throughout)")
        _check((self.target_acc_min is None) == (self.target_acc_max is None), "target_acc_max",
               "set both target_acc_min and target_acc_max (a band), or neither (a fixed num_steps)")
        if self.target_acc_min is not None and self.target_acc_max is not None:
            _check(0 <= self.target_acc_min <= self.target_acc_max <= 1, "target_acc_min",
                   f"must satisfy 0 <= target_acc_min <= target_acc_max={self.target_acc_max} <= 1")
        _check(not self.band_by_kind or self.target_acc_min is not None, "band_by_kind",
               "applies to a band: set target_acc_min and target_acc_max, or band_by_kind: false")

    @property
    def band(self) -> tuple[float, float] | None:
        """(min, max) held-out accuracy that ends SFT, or None for a fixed step count."""
        if self.target_acc_min is None or self.target_acc_max is None:
            return None
        return (self.target_acc_min, self.target_acc_max)


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts")
"""model.lora.target_modules' names (megatron's): attention's fused QKV and output projection, the
dense MLP's fused gate/up and down, and the routed experts' fc1/fc2; ``all-linear`` is all of them."""


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """Low-rank adapters on the actor's linears (megatron_dapo/lora): only they are trained."""

    rank: int = 0
    """Rank r of each adapter; 0 = off (full-parameter training)."""
    alpha: float = 16.0
    """Scale numerator: the adapter adds (alpha / rank) x B A x to the layer's output."""
    dropout: float = 0.0
    """Dropout on the adapter's input in training (tensor_model_parallel_size 1 only)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Which linears get adapters (megatron's names): linear_qkv (attention's fused q/k/v),
    linear_proj (attention's output), linear_fc1 (the dense MLP's fused gate/up), linear_fc2 (its
    down), experts (every routed expert's fc1 and fc2); or ["all-linear"], all of them."""

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "rank", "must be >= 0 (0 = off)")
        _check(self.alpha > 0, "alpha", "must be > 0")
        _check(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")
        names = ("all-linear", *LORA_TARGETS)
        bad = [t for t in self.target_modules if t not in names]
        _check(not bad, "target_modules", f"has {bad}; choose among {list(names)}")
        _check(bool(self.target_modules), "target_modules", f"is empty; choose among {list(names)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def targets(self) -> tuple[str, ...]:
        """The target names, all-linear expanded."""
        if "all-linear" in self.target_modules:
            return LORA_TARGETS
        return tuple(t for t in LORA_TARGETS if t in self.target_modules)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The actor (and rollout) model."""

    hf_checkpoint: str | None = None
    """HF checkpoint directory (config.json + safetensors). null = build `scratch` (embedded run)."""
    tokenizer: str | None = None
    """Tokenizer directory; null = the checkpoint's own, or the embedded task's tokenizer."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Parameter dtype: auto = bf16 with fp32 master weights on GPU, fp32 on CPU."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer implementation: auto = Transformer Engine when importable on CUDA, else local."""
    recompute_activations: bool = False
    """Recompute each layer's activations in backward (full, uniform) to save memory."""
    make_vocab_size_divisible_by: int = 128
    """Vocabulary padding multiple (times the tensor-parallel size), as Megatron-LM."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of megatron's switch load-balancing loss per MoE layer
    (0 = off, the usual choice when RL starts from a trained router; 1e-3 is Qwen3's pretraining value)."""
    scratch: ScratchModelConfig = field(default_factory=ScratchModelConfig)
    """Architecture used when hf_checkpoint is null."""
    sft_warm_start: SFTWarmStartConfig = field(default_factory=SFTWarmStartConfig)
    """SFT before RL for the scratch model."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (rank 0 = off): the base weights stay frozen, only adapters train."""

    def __post_init__(self) -> None:
        _check(self.make_vocab_size_divisible_by > 0, "make_vocab_size_divisible_by", "must be > 0")
        _check(self.moe_aux_loss_coeff >= 0, "moe_aux_loss_coeff", "must be >= 0")
        if self.hf_checkpoint is not None:
            _check(self.hf_checkpoint != "", "hf_checkpoint", "is empty: give a directory or null")
        _check_path(self.hf_checkpoint, "hf_checkpoint")
        _check_path(self.tokenizer, "tokenizer")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the actor is sharded: world = TP x PP x CP x DP."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel size (within a node)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages; must divide the number of layers."""
    context_parallel_size: int = 1
    """Context parallel size (needs Transformer Engine attention: GPU only)."""
    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = "p2p"
    """How CP attention exchanges keys/values (TE's names); p2p (ring) works with any number of KV heads per rank."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tensor_model_parallel_size > 1)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    expert_model_parallel_size: int = 1
    """Mixture-of-experts models: ranks of one pipeline stage that split a layer's experts
    (must divide num_experts; ep x etp must divide world / pp)."""
    expert_tensor_parallel_size: int | None = None
    """Ranks that shard one expert's weights; null = tensor_model_parallel_size (megatron's default)."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            _check(getattr(self, name) >= 1, name, "must be >= 1")
        if self.expert_tensor_parallel_size is not None:
            _check(self.expert_tensor_parallel_size >= 1, "expert_tensor_parallel_size", "must be >= 1 or null")
        if self.sequence_parallel:
            _check(self.tensor_model_parallel_size > 1, "sequence_parallel",
                   "needs tensor_model_parallel_size > 1; set it to false")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
