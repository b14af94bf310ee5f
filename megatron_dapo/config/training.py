"""The `optim`, `trainer` and `logging` sections: the optimizer, the loop's schedule,
checkpoints and devices, and where metrics go."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_dapo.config.fields import _check, _check_path


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with linear warm-up, then a constant learning rate (the paper's schedule) or a decay."""

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
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: constant (the paper), or a linear / cosine decay to min_lr_ratio x lr at
    lr_decay_steps (Megatron's lr_decay_style, verl's lr_scheduler_type)."""
    lr_decay_steps: int | None = None
    """Optimizer step at which the decay reaches its floor, warm-up included; None = the run's
    last (trainer.total_training_steps x train_batch_size / ppo_mini_batch_size x ppo_epochs)."""
    min_lr_ratio: float = 0.0
    """The decay's floor as a fraction of lr."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, "lr", "must be > 0")
        _check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        _check(0 <= self.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
        _check(0 <= self.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
        _check(self.adam_eps > 0, "adam_eps", "must be > 0")
        _check(self.clip_grad >= 0, "clip_grad", "must be >= 0 (0 = off)")
        _check(self.lr_warmup_steps >= 0, "lr_warmup_steps", "must be >= 0")
        _check(self.lr_decay_style in ("constant", "linear", "cosine"), "lr_decay_style",
               f"is {self.lr_decay_style!r}; choose constant, linear or cosine")
        _check(self.lr_decay_steps is None or self.lr_decay_steps > self.lr_warmup_steps, "lr_decay_steps",
               f"must be > lr_warmup_steps={self.lr_warmup_steps} (or null: the run's last optimizer step)")
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """The RL loop: steps, mini-batching, evaluation, checkpoints, launch shape."""

    total_training_steps: int = 100
    """RL steps (each: generate, score, filter, update, sync)."""
    ppo_mini_batch_size: int = 32
    """Prompt groups per optimizer step; train_batch_size / this = updates per RL step."""
    ppo_epochs: int = 1
    """Passes over each RL batch."""
    max_tokens_per_microbatch: int = 24576
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
        _check_path(self.output_dir, "output_dir")
        _check_path(self.resume, "resume")
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
    tensorboard: bool = False
    """Write the same scalars as metrics.jsonl as TensorBoard events under <output_dir>/tensorboard
    (`tensorboard --logdir <output_dir>/tensorboard`; needs the tensorboard package)."""
    mlflow: bool = False
    """Log the same scalars as metrics.jsonl to MLflow: experiment trainer.project_name, run
    trainer.experiment_name, continued by a resumed run (needs mlflow or mlflow-skinny). Metric
    names MLflow refuses are mapped ("val/pass@4" -> "val/pass_4")."""
    mlflow_tracking_uri: str | None = None
    """MLflow's tracking URI (e.g. http://mlflow.example:5000); null = a local file store under
    <output_dir>/mlruns (view it with MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri
    <output_dir>/mlruns)."""
    rollout_dump_freq: int = 0
    """Every N steps, append the step's sampled prompts, responses, scores, rewards and advantages
    (every response of the training batch) to <output_dir>/rollouts.jsonl; 0 = never."""

    def __post_init__(self) -> None:
        _check(self.rollout_dump_freq >= 0, "rollout_dump_freq", "must be >= 0 (0 = never)")
        _check(self.mlflow_tracking_uri is None or bool(self.mlflow_tracking_uri.strip()), "mlflow_tracking_uri",
               "is empty: give a tracking URI, or null for a file store under trainer.output_dir")
