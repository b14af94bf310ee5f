"""Everything that exists before step 1 of a run, and the per-step plumbing around it.

`build_run(cfg)` brings up, in order: the process group and device, the data (the
embedded task or the user's files), the initial HF checkpoint (given, or a scratch
model with an SFT warm start, cached), Megatron's parallel layout and the actor, its
optimizer state and the checkpoint it resumes from (both before any engine starts, which
sizes its memory from what is free then), the colocated SGLang engines (their leader ranks
on every node start them), then on the controller the engine clients, the reward pool and
the metrics, and finally the sampler's and collection's resumed state. `Run` carries these to the loop in trainer.py and offers the
small collective helpers the loop needs (dispatching the batch over DP ranks, weight
sync, checkpointing).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo import parallel
from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.actor.build import build_actor, model_dtype
from megatron_dapo.actor.optimizer_state import materialize_optimizer_state
from megatron_dapo.actor.reference import BaseOfAdapters, ReferencePolicy
from megatron_dapo.algo import LossSettings
from megatron_dapo.checkpoint import CheckpointManager, read_manifest, resolve_resume, step_of
from megatron_dapo.checkpoint.integrity import verify_checksums
from megatron_dapo.collect import CollectSettings, CollectState, Group, val_sampling_params
from megatron_dapo.collect.dump import ROLLOUTS_FILENAME, truncate_dump
from megatron_dapo.collect.shards import Shard, split_batch, to_shard
from megatron_dapo.collect.trained import record_trained_samples
from megatron_dapo.config import Config
from megatron_dapo.config.loader import to_dict
from megatron_dapo.config.preflight import check_device, check_hf_checkpoint, check_inputs
from megatron_dapo.data.datasets import PromptRecord, PromptSampler, load_prompt_dataset
from megatron_dapo.data.tokenizer import SPM_MODEL_FILENAME, Tokenizer, load_tokenizer
from megatron_dapo.device import release_cached_memory
from megatron_dapo.embedded import cache_root, scratch_checkpoint, task_of
from megatron_dapo.embedded.warm_start import warm_started
from megatron_dapo.errors import SharedUserError, UserError
from megatron_dapo.lora.sync import AdapterSync
from megatron_dapo.metrics import MetricsLogger
from megatron_dapo.models import DecoderAdapter, adapter_for
from megatron_dapo.output_dir import RunLock, check_output_dir, prepare_output_dir
from megatron_dapo.rewards.pool import REWARD_LOG, RewardPool
from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.factory import (
    broadcasts_weights,
    fleet_trainer_threads,
    launch_rank_engines,
    training_engines,
    weight_transport,
)
from megatron_dapo.rollout.fleet.stages import StageSender, sync_by_stage
from megatron_dapo.rollout.sglang.colocated import ColocatedEngines
from megatron_dapo.rollout.weight_sync import WeightSyncStats, sync_weights
from megatron_dapo.tools.registry import episode_runner

logger = logging.getLogger(__name__)

PREEMPTED_MARKER = "PREEMPTED"


@dataclass(kw_only=True)
class Run:
    """A live run: config, layout, actor, and on the controller the engines, rewards and data."""

    cfg: Config
    dims: parallel.ParallelDims
    adapter: DecoderAdapter
    actor: MegatronActor
    loss: LossSettings
    """DAPO loss settings of every optimizer step."""
    output_dir: Path
    hf_dir: Path
    """The HF checkpoint the run started from (its config/tokenizer files go into checkpoints)."""
    checkpoints: CheckpointManager
    control: parallel.ControlGroups
    """CPU groups where ranks wait for the controller and receive the batch."""
    reference: ReferencePolicy | None = None
    """The frozen starting policy; only with algorithm.use_kl_loss."""
    teacher: ReferencePolicy | None = None
    """The frozen distillation teacher; only with algorithm.distill.teacher."""
    start_step: int = 0
    tokenizer: Tokenizer | None = None
    sampler: PromptSampler | None = None
    val_prompts: list[PromptRecord] = field(default_factory=list)
    rollout: RolloutController | None = None
    colocated: ColocatedEngines | None = None
    """rollout.engine=sglang: this rank's share of the engines on every node (all ranks)."""
    stage_sender: StageSender = field(default_factory=StageSender)
    """A fleet under PP: this rank's group when it is a pipeline stage's first rank (fleet/stages.py)."""
    rewards: RewardPool | None = None
    collect_settings: CollectSettings | None = None
    collect_state: CollectState = field(default_factory=CollectState)
    val_sampling: SamplingParams | None = None
    metrics: MetricsLogger | None = None
    lock: RunLock | None = None
    """The controller's claim on output_dir (output_dir.RunLock), released by close()."""
    preempted_at: int | None = None
    """The step after which a signal stopped the run early (mark_preempted); None = not stopped."""
    _adapter_sync: AdapterSync | None = None
    """rollout.lora_sync=adapter: the adapter directories the engines serve (lora/sync.py)."""

    # ---------------------------------------------------------------- step plumbing

    def dispatch(self, groups: list[Group], step: int = 0) -> list[Shard]:
        """Split the controller's batch into mini-batches and each over DP ranks by tokens.

        Collective over the world: every rank receives its share of every mini-batch (TP and
        PP peers the same share), as `Shard`s in mini-batch order. `step` names the batch in the
        trained-sample record (collect/trained.py).
        """
        per_dp = None
        if self.dims.is_controller:
            per_dp = split_batch(groups, self.cfg.trainer.ppo_mini_batch_size, self.dims.dp,
                                  self.cfg.algorithm.overlong_filtering)
            record_trained_samples(step, groups, per_dp)
        # CPU/gloo, long timeout: the other ranks have waited here for the whole rollout.
        return [to_shard(rows) for rows in parallel.scatter_to_replicas(per_dp, self.control)]

    @property
    def _controller_feeds_colocated(self) -> bool:
        """A one-process CPU job's colocated server is fed by the controller, like a server it launched,
        so the controller keeps the weights and can restart the server (rollout.max_engine_restarts).
        GPUs and several ranks keep the ranks' own path (CUDA IPC per GPU, the IPC limbo collected)."""
        return self.dims.world_size == 1 and self.dims.device.type == "cpu"

    def sync_weights(self, version: int) -> WeightSyncStats:
        """Step 7: stream the actor's weights, as HF tensors, to every engine.

        Args:
            version: the step whose update made these weights (the start or resume step at first).
        """
        bucket_bytes = self.cfg.rollout.update_weights_bucket_megabytes << 20
        # Engines a failed sync left marked restart first, while the other ranks wait here in gloo:
        # in the sync they would wait in its collectives, whose deadline is short
        # (trainer.collective_timeout_minutes). The sync then reaches every engine (controller_sync.py).
        if self.rollout is not None:
            self.rollout.restart_failed_engines()
        if self.dims.world_size > 1:
            dist.barrier(group=self.control.world)
        if self.cfg.rollout.lora_sync == "adapter":  # the adapters alone, as a PEFT directory (lora/sync.py)
            if self._adapter_sync is None:
                self._adapter_sync = AdapterSync(self.output_dir, self.hf_dir, self.adapter.hf,
                                                 model_dtype(self.cfg, self.dims.device))
            return self._adapter_sync.sync(self.actor.lora, self.rollout, version)  # type: ignore[arg-type]
        if self.colocated is not None and not self._controller_feeds_colocated:
            # Each engine's own ranks feed it through shared memory (CUDA IPC on GPUs;
            # rollout/sglang/colocated.py), so every rank receives every tensor; the gathered
            # export buffers go back to the driver before the engines generate.
            export = self.adapter.export_hf(self.actor.model, self.dims, receivers="all")
            stats = self.colocated.sync_weights(export, bucket_bytes=bucket_bytes, version=version)
            release_cached_memory(self.dims.device)
            return stats
        if broadcasts_weights(self.cfg) and self.dims.pp > 1 and self.cfg.rollout.fleet_stage_groups:
            # A fleet under PP: each stage's first rank broadcasts its own stage's tensors to the
            # servers in a group of its own, in turns the controller sets (fleet/stages.py).
            export = self.adapter.export_hf(self.actor.model, self.dims, receivers="stages")
            return sync_by_stage(export, fleet=self.rollout, sender=self.stage_sender,  # type: ignore[arg-type]
                                 group=self.control.stage_sources, source_ranks=self.control.stage_source_ranks,
                                 rank=self.dims.rank, bucket_bytes=bucket_bytes, version=version)
        # The controller forwards each bucket to its engines and keeps it for an engine it may
        # restart; the other ranks only send it their shards (models/export.py).
        export = self.adapter.export_hf(self.actor.model, self.dims, receivers="controller")
        engines = [self.rollout] if self.rollout is not None else []
        return sync_weights(export, engines, is_controller=self.dims.is_controller,  # type: ignore[list-item]
                            bucket_bytes=bucket_bytes, version=version)

    def release_rollout_memory(self) -> None:
        """Colocated engines hand their GPU memory (weights, KV cache) to training (collective)."""
        if self.colocated is not None:
            self.colocated.release_memory()

    def resume_rollout_memory(self) -> None:
        """Colocated engines take their memory back; weights must be synced next (collective).

        The caching allocator still holds the training peak: every rank empties it first.
        """
        if self.colocated is not None:
            self.colocated.resume_memory(release_cache=lambda: release_cached_memory(self.dims.device))

    def rollout_throughput(self) -> dict[str, float]:
        """Per-engine generation throughput of the last step (controller)."""
        if self.rollout is None:
            return {}
        # Colocated servers of several ranks are restarted by their owners, from one job-wide count.
        shared = self.colocated is not None and self.colocated.restarts is not None
        restarts = self.colocated.num_restarts() if shared else self.rollout.num_restarts  # type: ignore[union-attr]
        return {**{f"rollout/{t.engine}/tokens_per_s": t.tokens_per_s for t in self.rollout.last_throughput},
                "rollout/engine_restarts": float(restarts)}

    def sum_over_dp(self, value: float) -> float:
        """Sum a number over data-parallel ranks (on every rank)."""
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, group=self.dims.dp_group)
        return float(t.item())

    def log(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Write a step's metrics (controller) and return them."""
        if self.metrics is not None:
            self.metrics.log(step, metrics)
        return metrics

    # ---------------------------------------------------------------- checkpoints

    def should_save(self, step: int) -> bool:
        interval = self.cfg.trainer.save_interval
        return step == self.cfg.trainer.total_training_steps or (interval > 0 and step % interval == 0)

    def data_position(self) -> dict[str, Any]:
        """The sampler's and collection's state now (what resumes the next step's collection)."""
        return {"sampler": self.sampler.state_dict() if self.sampler is not None else None,
                "collect": self.collect_state.state_dict(self.sampler)}

    def save(self, step: int, position: dict[str, Any] | None = None) -> None:
        """Checkpoint model, optimizer, schedule, RNG and the trainer's position (collective).

        Args:
            position: data_position() from before the next step's prompts were drawn (the
                asynchronous loop's producer has drawn ahead); None = now.
        """
        state = {"step": step, **(position or self.data_position())}
        states: list[Any] = [None] * self.dims.world_size
        dist.all_gather_object(states, state)
        self.checkpoints.save(step, [self.actor.model], self.actor.optimizer, self.actor.scheduler,
                              trainer_state=states[0], config_dict=to_dict(self.cfg), hf_dir=self.hf_dir)

    def mark_preempted(self, step: int) -> None:
        """Remember the early stop (every rank) and leave the marker the sbatch script reads to requeue
        the job (controller)."""
        self.preempted_at = step
        if self.dims.is_controller:
            (self.output_dir / PREEMPTED_MARKER).write_text(f"{step}\n")

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.rewards is not None:
            self.rewards.close()
        episodes = self.collect_settings.episodes if self.collect_settings is not None else None
        if episodes is not None:
            episodes.close()
        if self.rollout is not None:
            self.rollout.shutdown()
        if self.colocated is not None:
            self.colocated.shutdown()
        self.stage_sender.drop()
        if self.lock is not None:
            self.lock.release()


# ------------------------------------------------------------------------ building


class NothingToTrain(Exception):
    """The run would resume from a checkpoint of its last step (train.py exits EXIT_NOTHING_TO_TRAIN).

    Raised on every rank alike, before the warm start, the actor or the engines start.
    """

    def __init__(self, output_dir: Path, step: int, total: int) -> None:
        super().__init__(
            f"{output_dir} already holds the checkpoint of step {step} of trainer.total_training_steps={total}: "
            f"nothing to train; to continue this run raise trainer.total_training_steps (e.g. "
            f"trainer.total_training_steps={max(total, step) * 2}), or start afresh with a new trainer.output_dir")
        self.step = step


def build_run(cfg: Config, config_source: str) -> Run:
    """Bring up a run from a validated config (collective: call on every rank)."""
    try:
        check_device(cfg.trainer.device)  # every rank alike, before the process group needs the device
    except UserError as e:
        raise SharedUserError(str(e)) from None
    env = parallel.init_distributed(cfg.trainer.device, timeout_minutes=cfg.trainer.collective_timeout_minutes)
    cfg.check_world_size(env.world_size, _launcher_source())
    output_dir = Path(cfg.trainer.output_dir)
    locks: list[RunLock] = []

    def prepare() -> dict[str, str | None]:
        check_output_dir(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        # One trainer per directory: two delete each other's temporary checkpoints.
        locks.append(RunLock.acquire(output_dir))
        # Every check `config validate` runs, before anything is written or trained (the warm start).
        check_inputs(cfg, verify_resume_checksums=False, world_size=env.world_size, world_source=_launcher_source())
        resume = resolve_resume(cfg.trainer.resume, output_dir / "checkpoints")
        done = step_of(resume.resolve()) if resume is not None else None
        if done is not None and done >= cfg.trainer.total_training_steps:
            return {"finished_at": str(done)}  # nothing written, nothing built
        # Leftovers of a crashed save go first: after a full disk nothing else could write.
        prepare_output_dir(output_dir, cfg.trainer.resume)
        (output_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
        return {**prepare_sources(cfg, cache_root()), "cache_dir": str(cache_root())}

    try:
        sources = parallel.on_controller(prepare)
        if "finished_at" in sources:
            raise NothingToTrain(output_dir, int(sources["finished_at"]), cfg.trainer.total_training_steps)
        run = _build(cfg, env, output_dir, sources)
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    run.lock = locks[0] if locks else None
    return run


def _build(cfg: Config, env: Any, output_dir: Path, sources: dict[str, Any]) -> Run:
    """build_run after the checks: layout, warm start, actor, engines, controller, resume (collective)."""
    cache_dir = Path(sources["cache_dir"])
    resume_from = resolve_resume(cfg.trainer.resume, output_dir / "checkpoints")
    if resume_from is not None:
        # Every file's checksum, read over all ranks, before the warm start rather than at the load.
        try:
            verify_checksums(resume_from, read_manifest(resume_from))
        except UserError as e:
            raise SharedUserError(str(e)) from None
    hf_dir = Path(sources["hf_dir"])
    adapter = adapter_for(hf_dir)
    if cfg.model.moe_aux_loss_coeff:
        adapter = dataclasses.replace(adapter, moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff)
    hf = adapter.hf
    p = cfg.parallel
    dims = parallel.initialize_model_parallel(
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
        seed=cfg.trainer.seed, num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_kv_heads, num_layers=hf.num_layers,
        ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size, num_experts=hf.num_experts or None)

    control = parallel.build_control_groups(dims, cfg.trainer.controller_wait_timeout_minutes)

    if cfg.model.hf_checkpoint is None and cfg.model.sft_warm_start.enable:
        hf_dir = warm_started(cfg, adapter, hf_dir, sources, dims, control, cache_dir)
    if cfg.model.hf_checkpoint is None:
        parallel.on_controller(lambda: with_tokenizer(hf_dir, Path(sources["tokenizer"])))
    actor = build_actor(cfg, adapter, hf_dir, dims)

    loss = LossSettings.from_config(cfg.algorithm, cfg.rollout.temperature, cfg.data.max_response_length)
    # The reference is the policy RL starts from (after SFT warm start), also after a resume.
    # A LoRA actor's reference is its own base with the adapters off: no second copy of the weights.
    reference = (BaseOfAdapters(actor) if actor.lora is not None else ReferencePolicy(actor, hf_dir)) \
        if cfg.algorithm.use_kl_loss else None
    teacher_dir = cfg.algorithm.distill.teacher
    teacher = ReferencePolicy(actor, teacher_dir, adapter=adapter_for(teacher_dir)) if teacher_dir else None
    run = Run(cfg=cfg, dims=dims, adapter=adapter, actor=actor, loss=loss, reference=reference, teacher=teacher,
              output_dir=output_dir, hf_dir=hf_dir,
              checkpoints=CheckpointManager(output_dir / "checkpoints", keep_last=cfg.trainer.max_checkpoints_to_keep),
              control=control)
    try:
        _start_engines_and_resume(run, cfg, env, hf_dir, sources, resume_from)
    except BaseException:
        # Engines started and then the build failed (a resume, the first sync): stop them now, as
        # fit's failures do (train.py), not when their reaper sees this process die.
        try:
            run.close()
        except Exception:  # the build's own error is the one to report
            logger.exception("stopping the engines after the build failed")
        raise
    return run


def _start_engines_and_resume(run: Run, cfg: Config, env: Any, hf_dir: Path, sources: dict[str, Any],
                              resume_from: Path | None) -> None:
    """_build's last part: the engines and the controller, the resume, the first weight sync (collective)."""
    dims, actor = run.dims, run.actor
    # What training holds is resident before any engine starts: a colocated SGLang server sizes its
    # pool from the memory free at its start, once (actor/optimizer_state.py). So the optimizer's
    # state is made now, not at the first step, and a resumed checkpoint is loaded now, not after.
    made = materialize_optimizer_state(actor.optimizer)
    logger.info("optimizer state: %.3f GiB on this rank before the engines start", made / 2**30)
    state = run.checkpoints.load(resume_from, [actor.model], actor.optimizer, actor.scheduler, verified=True) \
        if resume_from is not None else None
    # Collective: engines the ranks own (colocated SGLang: each node's leader ranks start theirs).
    run.colocated = launch_rank_engines(cfg, hf_dir, rank=env.rank, world_size=env.world_size,
                                        local_rank=env.local_rank, log_dir=run.output_dir / "engine_logs",
                                        device=dims.device, dtype=model_dtype(cfg, dims.device))
    parallel.on_controller(lambda: _build_controller(run, hf_dir, sources))

    if resume_from is not None:
        assert state is not None
        run.start_step = int(state["step"])
        if run.sampler is not None and state.get("sampler") is not None:
            run.sampler.load_state_dict(state["sampler"])
        if state.get("collect") is not None:  # absent in checkpoints from before streaming
            run.collect_state.load_state_dict(state["collect"], run.sampler)
        if dims.is_controller and resume_from.resolve().parent == run.checkpoints.root.resolve():
            run.checkpoints.discard_after(run.start_step)
        logger.info("resumed from %s at step %d", resume_from, run.start_step)
    if run.metrics is not None:
        # Lines after the resume point (all of them when starting at step 0) are redone now.
        run.metrics.truncate_after(run.start_step if resume_from is not None else -1)
        truncate_dump(run.output_dir / ROLLOUTS_FILENAME, run.start_step if resume_from is not None else -1)
    # The engines start from the HF checkpoint; after a resume (or SFT) they need the actor's weights.
    run.sync_weights(version=run.start_step)
    # A CPU fleet beside an overlapped loop has its cores; the trainer keeps the rest (fleet/cores.py).
    # The fleet runs on the controller's node, whose ranks are the first (torchrun's and srun's
    # block order).
    threads = fleet_trainer_threads(cfg, env.local_world_size, dims.device.type) \
        if env.rank < env.local_world_size else None
    if threads is not None and threads < torch.get_num_threads():
        torch.set_num_threads(threads)
        logger.info("the fleet beside the trainer overlaps its update: %d torch thread(s) per trainer rank", threads)


def _build_controller(run: Run, hf_dir: Path, sources: dict[str, Any]) -> None:
    """Controller-only parts: tokenizer, prompts, engines, reward pool, metrics."""
    cfg = run.cfg
    tokenizer = load_tokenizer(sources["tokenizer"])
    train_files = cfg.data.train_files or [sources["train"]]
    val_files = cfg.data.val_files or ([sources["val"]] if sources["val"] else [])
    if train_files == [None]:
        raise UserError("data.train_files is empty and model.hf_checkpoint is set; give prompt files "
                        "(DAPO-Math-17K parquet/jsonl) in data.train_files")
    records = [r for f in train_files for r in load_prompt_dataset(f, tokenizer, cfg.data.max_prompt_length).records]
    run.tokenizer = tokenizer
    run.sampler = PromptSampler(records, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    run.val_prompts = [r for f in val_files for r in load_prompt_dataset(f, tokenizer, cfg.data.max_prompt_length).records]
    r = cfg.rollout
    stop = (tokenizer.eos_id,)
    sampling = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=cfg.data.max_response_length, stop_token_ids=stop,
                              seed=cfg.trainer.seed)
    run.val_sampling = val_sampling_params(r.val_kwargs, max_new_tokens=cfg.data.max_response_length,
                                           eos_id=tokenizer.eos_id, seed=cfg.trainer.seed)
    run.collect_settings = CollectSettings(
        n=r.n, sampling=sampling, gen_batch_size=cfg.data.gen_batch_size, train_batch_size=cfg.data.train_batch_size,
        filter_enable=cfg.algorithm.filter_groups.enable, filter_metric=cfg.algorithm.filter_groups.metric,
        max_num_gen_batches=cfg.algorithm.filter_groups.max_num_gen_batches,
        streaming=cfg.algorithm.filter_groups.mode == "streaming", partial_rollout=r.partial_rollout,
        partial_max_versions=r.partial_rollout_max_versions,
        max_staleness=cfg.trainer.max_staleness or None,
        max_response_length=cfg.data.max_response_length, overlong_enable=cfg.reward.overlong_buffer.enable,
        overlong_len=cfg.reward.overlong_buffer.len, overlong_penalty_factor=cfg.reward.overlong_buffer.penalty_factor,
        norm_adv_by_std=cfg.algorithm.norm_adv_by_std_in_grpo,
        episodes=episode_runner(cfg.tools, tokenizer, cfg.data.max_response_length, log_dir=run.output_dir))
    engines = training_engines(cfg, hf_dir, run.colocated, run.dims.device, run.output_dir)
    run.rollout = RolloutController(engines, max_restarts=cfg.rollout.max_engine_restarts,
                                    transport=weight_transport(cfg, engines, run.dims.device))
    run.rewards = RewardPool(cfg.reward.reward_fn, cfg.reward.num_workers, cfg.reward.timeout_s,
                             max_failure_fraction=cfg.reward.max_failure_fraction,
                             log_path=run.output_dir / REWARD_LOG)
    lg = cfg.logging
    run.metrics = MetricsLogger(run.output_dir, cfg.trainer.project_name, cfg.trainer.experiment_name,
                                use_wandb=lg.wandb, total_steps=cfg.trainer.total_training_steps,
                                wandb_mode=lg.wandb_mode, config=to_dict(cfg), console=lg.console, jsonl=lg.jsonl,
                                tensorboard=lg.tensorboard, mlflow=lg.mlflow, mlflow_tracking_uri=lg.mlflow_tracking_uri)


def _launcher_source() -> str:
    if "WORLD_SIZE" in os.environ:
        return f"WORLD_SIZE={os.environ['WORLD_SIZE']} from the launcher"
    if "SLURM_NTASKS" in os.environ:
        return f"SLURM_NTASKS={os.environ['SLURM_NTASKS']}"
    return "a single process"


def with_tokenizer(hf_dir: Path, spm_model: Path) -> None:
    """Put the embedded task's tokenizer into its (cached) HF directory, so that checkpoints
    carry it in hf/ and an export can be trained from (data/tokenizer.py reads it back)."""
    target = hf_dir / SPM_MODEL_FILENAME
    if target.is_file():
        return
    tmp = hf_dir / f".{SPM_MODEL_FILENAME}.{os.getpid()}"
    shutil.copyfile(spm_model, tmp)
    os.replace(tmp, target)


def prepare_sources(cfg: Config, cache_dir: Path) -> dict[str, str | None]:
    """Controller: make the embedded task and scratch checkpoint if needed; return paths."""
    if cfg.model.hf_checkpoint is not None:
        # Here, once, rather than as a traceback on every rank while the actor loads.
        check_hf_checkpoint(cfg.model.hf_checkpoint)
        load_tokenizer(cfg.model.tokenizer or cfg.model.hf_checkpoint)
        return {"hf_dir": cfg.model.hf_checkpoint, "tokenizer": cfg.model.tokenizer or cfg.model.hf_checkpoint,
                "train": None, "val": None, "sft_path": None}
    task = task_of(cfg, cache_dir)
    tokenizer = load_tokenizer(task.tokenizer_path)
    scratch = scratch_checkpoint(cfg.model.scratch, tokenizer.vocab_size, cfg.trainer.seed, cache_dir)
    return {"hf_dir": str(scratch), "tokenizer": str(task.tokenizer_path), "train": str(task.train_path),
            "val": str(task.val_path), "sft_path": str(task.sft_path)}
