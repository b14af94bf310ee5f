"""`Config`, a whole experiment: every section, and the rules that span sections.

Batch divisibility, the model's shape against the parallel sizes, the launcher's world
size: whatever no single section can check alone is checked here, with the same one-line
errors (`_check` names the key the user must change).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_dapo.config.algorithm import AlgorithmConfig
from megatron_dapo.config.data import DataConfig
from megatron_dapo.config.fields import ConfigError, _check, _FieldError
from megatron_dapo.config.model import ModelConfig, ParallelConfig
from megatron_dapo.config.reward import RewardConfig
from megatron_dapo.config.rollout import VLLM_MAX_LORA_RANKS, RolloutConfig
from megatron_dapo.config.tools import ToolsConfig
from megatron_dapo.config.training import LoggingConfig, OptimConfig, TrainerConfig


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
    tools: ToolsConfig = field(default_factory=ToolsConfig)

    def __post_init__(self) -> None:
        self._cross_checks()

    def _cross_checks(self) -> None:
        d, t, r, a = self.data, self.trainer, self.rollout, self.algorithm
        if d.train_batch_size % t.ppo_mini_batch_size != 0:
            _check(False, "trainer.ppo_mini_batch_size", f"must divide data.train_batch_size={d.train_batch_size} "
                   f"(choose one of {_divisors(d.train_batch_size)})")
        longest = d.max_prompt_length + d.max_response_length
        # The budget is what bounds a micro-batch's activation memory (and the planner's estimate);
        # below one sequence every sequence gets a micro-batch of its own and the bound is gone.
        _check(t.max_tokens_per_microbatch >= longest, "trainer.max_tokens_per_microbatch",
               f"={t.max_tokens_per_microbatch} is below one sequence (data.max_prompt_length + "
               f"data.max_response_length = {longest}); raise it to at least {longest}")
        if a.filter_groups.enable:
            _check(r.n >= 2, "rollout.n",
                   "must be >= 2 with algorithm.filter_groups.enable=true (a group of one has no spread)")
        if a.distill.enabled and a.distill.reward_weight == 0:
            _check(not a.filter_groups.enable, "algorithm.distill.reward_weight",
                   "trains on the teacher's signal alone (0), but dynamic sampling keeps only groups whose task "
                   "reward varies; set algorithm.filter_groups.enable=false (or reward_weight > 0)")
        if r.partial_rollout:
            _check(a.filter_groups.enable and a.filter_groups.mode == "streaming", "rollout.partial_rollout",
                   "continues responses that streaming aborted; it needs algorithm.filter_groups.enable=true "
                   "and algorithm.filter_groups.mode=streaming")
        if t.max_staleness > 0:
            _check(r.placement == "disaggregated", "trainer.max_staleness",
                   "needs rollout.placement=disaggregated: colocated engines share the actor's devices and "
                   "cannot generate while it trains (or set trainer.max_staleness=0)")
            rc = a.rollout_correction
            _check(rc.corrects_staleness or rc.allow_uncorrected_staleness, "algorithm.rollout_correction.rollout_is",
                   f"trainer.max_staleness={t.max_staleness} trains on responses of older weights with no correction; "
                   "set algorithm.rollout_correction.rollout_is=token (or rollout_rs, or bypass_mode=true), or "
                   "algorithm.rollout_correction.allow_uncorrected_staleness=true if the biased update is intended")
        moe = self._moe_model()
        if moe is not None:
            check_moe_layout(self.parallel, moe)
        if a.routing_replay != "off":
            _check(self.model.hf_checkpoint is not None or self.model.scratch.family == "qwen3_moe",
                   "algorithm.routing_replay", f"needs a mixture-of-experts model "
                   f"(model.scratch.family={self.model.scratch.family}); set algorithm.routing_replay=off")
        if a.routing_replay == "rollout":
            # Which engines report routes at the pinned versions: DESIGN.md, "Rollout routing replay".
            _check(r.engine != "vllm", "algorithm.routing_replay",
                   "needs the engine's routed experts, which rollout.engine=vllm does not report here "
                   "(vLLM 0.32 returns them only from its Model Runner V2); use rollout.engine=sglang or local, "
                   "or algorithm.routing_replay=old_policy")
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
        if self.model.lora.enabled:
            self._check_lora(moe)
        if r.lora_sync == "adapter":
            self._check_adapter_sync(moe)
        p = self.parallel
        if p.context_parallel_size > 1:
            _check(t.device != "cpu", "parallel.context_parallel_size",
                   "needs Transformer Engine attention on CUDA; set it to 1 with trainer.device=cpu")
        self._check_model_shape(*self._model_shape())

    def _check_lora(self, moe: str | None) -> None:
        """model.lora pairs the actor cannot build (lora/layers.py), refused before anything starts."""
        lora, p = self.model.lora, self.parallel
        _check(self.model.transformer_impl != "transformer_engine", "model.lora.rank",
               "needs megatron's local layer spec (Transformer Engine's fused linears are not wired for adapters "
               "yet); set model.transformer_impl=local (or auto, which picks local with LoRA)")
        _check(p.context_parallel_size == 1, "model.lora.rank",
               f"needs parallel.context_parallel_size=1, not {p.context_parallel_size}: context parallelism runs on "
               "Transformer Engine's attention, and adapters on megatron's local layer spec")
        _check(lora.dropout == 0 or p.tensor_model_parallel_size == 1, "model.lora.dropout",
               "needs parallel.tensor_model_parallel_size=1 (TP ranks would draw different masks on "
               "replicated inputs); set model.lora.dropout=0")
        explicit = "all-linear" not in lora.target_modules
        _check(not (explicit and "experts" in lora.targets and moe is None), "model.lora.target_modules",
               "has experts, and the model is dense; leave experts out")
        etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
        _check(moe is None or "experts" not in lora.targets or etp == 1, "model.lora.target_modules",
               f"has experts (all-linear includes them), whose weights are split over expert_tensor_parallel_size={etp}"
               "; adapters on split experts are not supported: set parallel.expert_tensor_parallel_size=1 or list "
               "the targets without experts")

    def _check_adapter_sync(self, moe: str | None) -> None:
        """rollout.lora_sync=adapter where an engine serves LoRA adapters loaded at run time: vLLM 0.32 and
        SGLang 0.5.3-0.5.23, the server(s) beside the trainer (DESIGN.md "LoRA")."""
        r, lora = self.rollout, self.model.lora
        _check(lora.enabled, "rollout.lora_sync", "=adapter sends LoRA adapters, and model.lora.rank is 0; set "
               "model.lora.rank > 0 or rollout.lora_sync=merged")
        _check(r.engine in ("vllm", "sglang") and r.placement == "colocated", "rollout.lora_sync",
               f"=adapter needs rollout.engine=vllm or sglang with rollout.placement=colocated (servers beside the "
               f"trainer, which load each step's adapter directory), not engine={r.engine} placement={r.placement}; "
               "use rollout.lora_sync=merged (every engine and placement)")
        _check(self.trainer.max_staleness == 0, "rollout.lora_sync",
               "=adapter swaps the served adapter between steps: set trainer.max_staleness=0, or use merged")
        _check(r.engine != "vllm" or lora.rank <= VLLM_MAX_LORA_RANKS[-1], "model.lora.rank",
               f"={lora.rank} is above vLLM's largest --max-lora-rank {VLLM_MAX_LORA_RANKS[-1]}; lower it or use "
               "rollout.lora_sync=merged")
        # vLLM: no LoRA on experts on CPU. SGLang: FusedMoEWithLoRA runs its experts' adapters on the
        # Triton MoE runner only (0.5.18 lora/layers.py:992, 0.5.23 :1075), which has no CPU form.
        why = {"vllm": "vLLM serves no LoRA on experts on CPU",
               "sglang": "SGLang runs LoRA on experts with Triton kernels only (none on CPU; untested on GPUs)"}
        _check(moe is None, "rollout.lora_sync", f"=adapter: {why[r.engine]} and this model is a "
               f"mixture of experts ({moe}); use rollout.lora_sync=merged")

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
    def optimizer_steps(self) -> int:
        """Optimizer steps of the whole RL run (the lr decay's default length)."""
        t = self.trainer
        return t.total_training_steps * (self.data.train_batch_size // t.ppo_mini_batch_size) * t.ppo_epochs

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
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deeply
            raise _FieldError("model.hf_checkpoint", f"cannot read {cfg_path}: {e}") from None
        heads = int(hf.get("num_attention_heads", 0))
        return heads, int(hf.get("num_key_value_heads", heads)), int(hf.get("num_hidden_layers", 0)), str(cfg_path)

    def _moe_model(self) -> str | None:
        """Names the configured model if it is a mixture of experts (config.json's expert count), else None."""
        if self.model.hf_checkpoint is None:
            return "model.scratch.family=qwen3_moe" if self.model.scratch.family == "qwen3_moe" else None
        cfg_path = Path(self.model.hf_checkpoint) / "config.json"
        try:
            hf = json.loads(cfg_path.read_text())
        except (OSError, ValueError, RecursionError):
            return None  # _model_shape reports an unreadable file; a missing one is checked at load
        experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        return f"{experts} experts in {cfg_path}" if isinstance(experts, int) and experts > 1 else None

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
        _check(layers >= pp, "parallel.pipeline_model_parallel_size",
               f"={pp} is more stages than the {layers} layers of {where}; use at most {layers} (a size that "
               "does not divide the layers gives uneven stages)")

    def check_world_size(self, world_size: int, source: str) -> int:
        """Validate the launcher's world size against the layout; returns the data-parallel size.

        Raises:
            ConfigError: when TP x PP x CP (or a mixture-of-experts model's EP x ETP x PP) does
                not divide the world size, or nnodes x n_gpus_per_node disagrees with the launcher.
        """
        p, t = self.parallel, self.trainer
        mp = p.model_parallel_size
        if t.n_gpus_per_node is not None and t.nnodes * t.n_gpus_per_node != world_size:
            raise ConfigError(
                f"trainer.nnodes x trainer.n_gpus_per_node = {t.nnodes}x{t.n_gpus_per_node} but the launcher "
                f"started {world_size} processes ({source}); fix the config or the launch command"
            )
        if world_size % mp != 0:
            raise ConfigError(
                f"parallel: TP x PP x CP = {p.tensor_model_parallel_size}x{p.pipeline_model_parallel_size}x"
                f"{p.context_parallel_size} = {mp} does not divide the world size {world_size} ({source}); "
                f"launch a multiple of {mp} processes or shrink the parallel sizes"
            )
        ep, pp = p.expert_model_parallel_size, p.pipeline_model_parallel_size
        etp = p.tensor_model_parallel_size if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size
        if (ep > 1 or etp != p.tensor_model_parallel_size) and world_size % (ep * etp * pp) != 0:
            # megatron-core's expert grid (parallel.validate_layout): EP x ETP ranks of one stage.
            raise ConfigError(
                f"parallel: EP x ETP x PP = {ep}x{etp}x{pp} = {ep * etp * pp} does not divide the world size "
                f"{world_size} ({source}); expert groups hold EP x ETP ranks of one pipeline stage: change "
                "expert_model_parallel_size or expert_tensor_parallel_size"
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


def check_moe_layout(p: ParallelConfig, model: str) -> None:
    """A mixture-of-experts model's layout rules that megatron-core would otherwise raise inside the actor.

    Args:
        p: the parallel section.
        model: names the model in the message (the scratch family, or the HF checkpoint).

    Raises:
        _FieldError: TP > 1 without sequence parallelism (megatron-core 0.16.1's MoELayer.forward
            raises in training with TP > 1 and no SP).
    """
    _check(p.tensor_model_parallel_size == 1 or p.sequence_parallel, "parallel.sequence_parallel",
           f"must be true with parallel.tensor_model_parallel_size={p.tensor_model_parallel_size} for a "
           f"mixture-of-experts model ({model}; megatron-core's MoE layer needs it at TP > 1); set "
           "parallel.sequence_parallel=true")


def _divisors(n: int, most: int = 12) -> str:
    """The divisors of n, smallest first, at most `most` of them shown (O(sqrt n): n may be 10^12)."""
    small, large = [], []
    k = 1
    while k * k <= n:
        if n % k == 0:
            small.append(k)
            if k != n // k:
                large.append(n // k)
        k += 1
        if len(small) >= most:
            break
    found = [*small, *reversed(large)] if len(small) < most else small
    shown = ", ".join(map(str, found[:most]))
    return f"[{shown}, ...]" if len(found) > most or len(small) >= most else f"[{shown}]"
