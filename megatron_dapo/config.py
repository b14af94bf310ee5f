"""Typed experiment configuration: one dataclass per component, YAML in, YAML out.

YAML is only a way to write these dataclasses. Loading is strict: an unknown key, a
wrong type or an inconsistent value fails at load time with one line that names the
key, where it came from (the file or the command line) and the fix, so a typo never
silently becomes a default in a 128-GPU job. Key names follow verl's where one exists
(clip_ratio_low, loss_agg_mode, filter_groups.*, gen_batch_size, ppo_mini_batch_size,
overlong_buffer.*, max_response_length, ...) so a verl DAPO recipe maps over by eye.

Batch sizes count prompts (groups), as in verl: a step trains on
`data.train_batch_size * rollout.n` responses.

This module holds the data, optimizer, reward, trainer and logging sections and `Config`,
which assembles all sections and checks the rules that span them (batch divisibility,
model shape against the parallel sizes, the launcher's world size). The model, parallel,
rollout and algorithm sections and the validation primitives live in config_sections.py
and are re-exported here: import every config name from megatron_dapo.config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_dapo.config_sections import (
    LOSS_AGG_MODES,
    AlgorithmConfig,
    ConfigError,
    FilterGroupsConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    ScratchModelConfig,
    SFTWarmStartConfig,
    ValKwargsConfig,
    _check,
    _FieldError,
)

__all__ = [
    "LOSS_AGG_MODES",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EmbeddedTaskConfig",
    "FilterGroupsConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SFTWarmStartConfig",
    "ScratchModelConfig",
    "TrainerConfig",
    "ValKwargsConfig",
]

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
    shared_prompts: bool = True
    """Each prompt goes through the actor once per micro-batch for all its responses
    (actor/shared_layout.py). Applies on CPU with context parallelism 1 (GPUs run TE's
    packed rows, or padded rows without TE); the budget above then counts each prompt
    once. false = padded rows."""
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
    max_staleness: int = 0
    """Asynchronous training (rollout.placement=disaggregated): the batch of a step may be
    generated by weights at most this many versions older than the ones it trains; 0 =
    synchronous. verl's staleness_threshold, NeMo-RL's max_trajectory_age_steps."""

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
        _check(self.max_staleness >= 0, "max_staleness", "must be >= 0 (0 = synchronous)")
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
        if t.max_staleness > 0:
            _check(r.placement == "disaggregated", "trainer.max_staleness",
                   "needs rollout.placement=disaggregated: colocated engines share the actor's devices and "
                   "cannot generate while it trains (or set trainer.max_staleness=0)")
            _check(not r.partial_rollout, "rollout.partial_rollout",
                   "is not supported with trainer.max_staleness > 0 yet (a carried response's oldest tokens "
                   "could exceed the bound); set one of them off")
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
        "recompute": a forward-only pass over the whole batch before the first update (step
        5), needed when a rollout correction (IS weights, rejection) must weigh the batch
        before the update.
        "current": no correction. The first mini-batch's update runs on the weights that are
        the old policy, so its old log-probs are the detached log-probs of its own forward
        (ratio exactly 1; later epochs reuse them); only the later mini-batches, trained
        after the weights moved, get a forward-only pass before the first update
        (`old_log_prob_pass_fraction`). With one update per step there is no extra pass.
        """
        rc = self.algorithm.rollout_correction
        if rc.bypass_mode:
            return "rollout"
        correcting = rc.rollout_is is not None or rc.rollout_rs is not None
        return "recompute" if correcting else "current"

    @property
    def old_log_prob_pass_fraction(self) -> float:
        """The share of the batch the forward-only old-log-prob pass covers (planner and docs)."""
        source = self.old_log_probs_source
        if source != "current":
            return 1.0 if source == "recompute" else 0.0
        mini_batches = self.data.train_batch_size // self.trainer.ppo_mini_batch_size
        return (mini_batches - 1) / mini_batches

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
