"""The DAPO loop. `fit` reads like the step list of DESIGN.md:

    1-4. controller: generate, score, filter until the batch is full, advantages
    4.   the batch is split over data-parallel ranks by token count
    5.   all ranks: old log-probs with Megatron (forward only) for every mini-batch but the
         first, whose own training forward supplies them (Config.old_log_probs_source);
         for all of them when a rollout correction must weigh the batch first; with the KL
         loss, the frozen reference's log-probs too; with distillation, the teacher's, whose
         reverse KL joins each token's advantage
    6.   all ranks: one optimizer step per mini-batch, global token-mean loss
    7.   all ranks: weights Megatron -> rollout engines
    8.   controller: metrics; everyone: evaluation and checkpoints

One process per device (torchrun or srun); global rank 0 is also the controller, the
only rank that talks to rollout engines, the reward pool, the data and the metrics.
Setup (what exists before step 1) lives in run.py; this module is the loop.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.algo.distill import distill_advantages
from megatron_dapo.algo.rollout_correction import CorrectionStats, rollout_correction
from megatron_dapo.collect import Group, collect_batch, score_heldout
from megatron_dapo.collect.dump import ROLLOUTS_FILENAME, dump_rollouts, should_dump
from megatron_dapo.collect.producer import RolloutProducer, check_staleness, staleness_metrics
from megatron_dapo.collect.shards import Shard
from megatron_dapo.faults import fault_point
from megatron_dapo.metrics import Timer
from megatron_dapo.run import NothingToTrain, Run

logger = logging.getLogger(__name__)


class Preempted(Exception):
    """The run stopped early on a signal, after saving step `step` (train.py exits EXIT_PREEMPTED)."""

    def __init__(self, step: int, total: int) -> None:
        super().__init__(f"stopped at step {step} of {total} on a signal (preemption or time limit); its checkpoint "
                         "is saved: rerun the same command to resume")
        self.step = step


class PreemptionFlag:
    """Set by SIGUSR1/SIGTERM (SLURM's pre-timeout signal, preemption) or Ctrl-C; read after a step.

    A second Ctrl-C interrupts at once (KeyboardInterrupt; train.py exits 130).
    """

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        logger.warning("received %s: saving a checkpoint after this step, then exiting", signal.Signals(signum).name)
        self.requested = True

    def agreed(self, group: dist.ProcessGroup) -> bool:
        """True on every rank if any rank got the signal (ranks must stop at the same step).

        Args:
            group: a gloo group of every rank (the flag is a CPU tensor; the controller may
                still be validating while the others wait here).
        """
        flag = torch.tensor([1.0 if self.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)


def fit(run: Run) -> dict[str, float]:
    """Train for trainer.total_training_steps RL steps from wherever the run resumed.

    Returns:
        The last step's metrics on the controller ({} elsewhere).
    """
    cfg, dims = run.cfg, run.dims
    preemption = PreemptionFlag()
    timer = Timer()
    last: dict[str, float] = {}
    if run.start_step >= cfg.trainer.total_training_steps:  # a resume path not named step_<N> (build_run's check)
        raise NothingToTrain(run.output_dir, run.start_step, cfg.trainer.total_training_steps)
    producer = start_producer(run) if cfg.rollout.placement == "disaggregated" and dims.is_controller else None
    try:
        last = _train(run, producer, preemption, timer)
    finally:
        if producer is not None:
            stop_producer(run, producer)
    if run.preempted_at is not None:
        raise Preempted(run.preempted_at, cfg.trainer.total_training_steps)
    return last


def _train(run: Run, producer: RolloutProducer | None, preemption: PreemptionFlag, timer: Timer) -> dict[str, float]:
    cfg, dims = run.cfg, run.dims
    last: dict[str, float] = {}
    if run.start_step == 0 and cfg.trainer.val_before_train and cfg.trainer.test_freq > 0:
        last = run.log(0, producer.validation(0) if producer is not None else validate(run))
    for step in range(run.start_step + 1, cfg.trainer.total_training_steps + 1):
        step_start = time.perf_counter()
        metrics: dict[str, float] = {}
        groups: list[Group] = []
        fault_point("rollout", dims.rank)
        if producer is not None:
            with timer("actor_idle"):  # the batch was generated while the actor trained
                produced = producer.batch_for(step)
            check_staleness(produced.groups, step, cfg.trainer.max_staleness)
            groups = produced.groups
            metrics.update(produced.metrics)
            metrics.update(staleness_metrics(groups, step, cfg.trainer.max_staleness))
        elif dims.is_controller:
            with timer("collect"):  # steps 1-4; split into timing_s/gen and timing_s/reward below
                groups, collect_metrics = collect(run, step)
            metrics.update(collect_metrics)
        if dims.is_controller and should_dump(step, cfg.logging.rollout_dump_freq):
            dump_rollouts(run.output_dir / ROLLOUTS_FILENAME, step, groups, run.tokenizer)
        shards, update_metrics = update_policy(run, groups, timer, version=step)
        metrics.update(update_metrics)
        if dims.is_controller:  # after the sync: a restart its start made is this step's too
            metrics.update(run.rollout_throughput())
        if producer is not None:
            producer.weights_synced(step)
        if cfg.trainer.test_freq > 0 and (step % cfg.trainer.test_freq == 0 or step == cfg.trainer.total_training_steps):
            with timer("testing"):
                metrics.update(producer.validation(step) if producer is not None else validate(run))
        metrics.update(timer.pop())
        metrics["timing_s/step"] = time.perf_counter() - step_start
        num_tokens = sum(int(shard.batch.seq_lens.sum()) for shard in shards)
        metrics["perf/throughput_tokens_per_s"] = run.sum_over_dp(num_tokens) / metrics["timing_s/step"]
        if dims.device.type == "cuda":  # this rank's peak (the controller's: actor + local engine)
            metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(dims.device) / 2**30
        # Log before saving: a run killed in between redoes this step after the resume, and
        # the resume drops the logged line first (metrics.truncate_after), so no step is lost.
        last = run.log(step, metrics)
        stop = preemption.agreed(run.control.world)
        if stop or run.should_save(step):
            run.save(step, producer.resume_state_after(step) if producer is not None else None)
        if stop and step < cfg.trainer.total_training_steps:
            run.mark_preempted(step)
            break
    return last


def collect(run: Run, step: int) -> tuple[list[Group], dict[str, float]]:
    """Steps 1-4 on the controller: the step's training batch and its metrics."""
    return collect_batch(run.sampler, step, rollout=run.rollout, rewards=run.rewards, tokenizer=run.tokenizer,
                         settings=run.collect_settings, state=run.collect_state)


def stop_producer(run: Run, producer: RolloutProducer, timeout_s: float = 60.0) -> None:
    """End the rollout thread: it stops at its next check, and its engine call is aborted.

    An engine clears its abort flag when a call starts, so one abort sent between two calls
    (rounds, an evaluation) would be lost: abort again until the thread is gone.
    """
    producer.stop()
    deadline = time.monotonic() + timeout_s
    while producer.is_alive() and time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # an engine that died cannot abort; the error that
            run.rollout.abort()               # ended the run is the one to report
        producer.join(timeout_s=0.5)
    if producer.is_alive():
        logger.warning("the rollout thread did not stop within %.0f s; exiting without it", timeout_s)


def start_producer(run: Run) -> RolloutProducer:
    """The controller's rollout thread of the asynchronous loop (collect/producer.py)."""
    t, rc = run.cfg.trainer, run.cfg.algorithm.rollout_correction
    if t.max_staleness > 0 and not rc.corrects_staleness:  # config allowed it: allow_uncorrected_staleness
        logger.warning("trainer.max_staleness=%d without a rollout correction (allow_uncorrected_staleness): the "
                       "update treats responses of older weights as its own, a biased gradient (the tiny run did "
                       "not learn in 40 steps at staleness 1 without it)", t.max_staleness)
    versions = {v for v in range(run.start_step + 1, t.total_training_steps + 1)
                if t.test_freq > 0 and (v % t.test_freq == 0 or v == t.total_training_steps)}
    if run.start_step == 0 and t.val_before_train and t.test_freq > 0:
        versions.add(0)

    def timed_collect(step: int) -> tuple[list[Group], dict[str, float]]:
        started = time.perf_counter()
        groups, metrics = collect(run, step)
        metrics["timing_s/collect"] = time.perf_counter() - started
        return groups, metrics

    return RolloutProducer(first_step=run.start_step + 1, last_step=t.total_training_steps,
                           max_staleness=t.max_staleness, start_version=run.start_step, collect=timed_collect,
                           snapshot=run.data_position, validate=lambda: validate(run),
                           validate_versions=frozenset(versions)).start()


def update_policy(run: Run, groups: list[Group], timer: Timer, *, version: int) -> tuple[list[Shard], dict[str, float]]:
    """Steps 5-7 on every rank: dispatch the batch, (old/ref) log-probs, the actor update, weight sync.

    Args:
        groups: the controller's training batch ([] on other ranks).
        timer: collects timing_s/dispatch, ref, teacher, old_log_prob, update_actor and sync.
        version: the step, which names the new weights on the engines.

    Returns:
        This rank's shards and the step's actor, mismatch and sync metrics.
    """
    cfg, actor = run.cfg, run.actor
    fault_point("dispatch", run.dims.rank)
    with timer("dispatch"):
        shards = run.dispatch(groups, step=version)  # this rank's mini-batches: list[Shard]
        run.release_rollout_memory()  # colocated engines free the GPUs for training
    if run.reference is not None:
        with timer("ref"):
            compute_ref_log_probs(run, shards)
    distill: dict[str, float] = {}
    if run.teacher is not None:
        with timer("teacher"):
            distill = add_teacher_advantages(run, shards)
    replay = cfg.algorithm.routing_replay
    if replay == "rollout":
        for shard in shards:  # R3: every pass routes as the engine did
            if shard.batch.routes is None and shard.batch.num_seqs:
                raise RuntimeError("algorithm.routing_replay=rollout but the engine reported no routed experts")
            shard.batch.replay_routes = shard.batch.routes
    probe: dict[str, float] = {}
    if replay == "rollout" and shards and shards[0].batch.routes is not None:
        with timer("replay_probe"):
            probe = free_routing_mismatch(run, shards[0])
    source = cfg.old_log_probs_source
    drift: dict[str, float] = {}
    if source == "recompute":
        with timer("old_log_prob"):
            compute_old_log_probs(run, shards)
            drift = rollout_mismatch(run, shards, correct=True)
    elif source == "rollout":  # bypass: PPO's anchor is the engine's own policy
        for shard in shards:
            shard.batch.old_log_probs = shard.rollout_log_probs
    old_from_forward = source == "current"
    if old_from_forward and len(shards) > 1:
        # The first mini-batch is trained on the weights that are the old policy, so its own
        # forward supplies its old log-probs; the later ones need theirs before that update.
        with timer("old_log_prob"):
            compute_old_log_probs(run, shards[1:])
    fault_point("update", run.dims.rank)
    with timer("update_actor"):
        # R2's first mini-batch without an old-log-prob pass trains on the old policy itself:
        # its own routes are the old policy's, nothing to replay.
        actor_metrics = [actor.train_step(shard.batch, run.loss, old_from_forward=old_from_forward and epoch == i == 0,
                                          replay=replay != "off" and shard.batch.replay_routes is not None)
                         for epoch in range(cfg.trainer.ppo_epochs) for i, shard in enumerate(shards)]
    if old_from_forward:  # every mini-batch has its old log-probs now (the first from its forward)
        drift = rollout_mismatch(run, shards, correct=False)
    with timer("sync"):
        run.resume_rollout_memory()
        sync_stats = run.sync_weights(version=version)
    metrics = mean_metrics(actor_metrics)
    metrics.update(actor.route_metrics())  # moe/router_disagreement, moe/replay_route_mismatch
    metrics.update(drift)
    metrics.update(probe)
    metrics.update(distill)
    metrics["sync/num_bytes"] = float(sync_stats.num_bytes)
    return shards, metrics


def compute_old_log_probs(run: Run, shards: list[Shard]) -> None:
    """Fill each mini-batch's old_log_probs with the current policy's (step 5), in place.

    Routing replay: R3 replays the engine's routes here too; R2 records this pass's routes
    (batch.replay_routes) for the update to replay.
    """
    mode = run.cfg.algorithm.routing_replay
    for shard in shards:
        shard.batch.old_log_probs, _ = run.actor.compute_log_probs(
            shard.batch, run.cfg.rollout.temperature, response_only=True, replay=mode == "rollout",
            record_routes=mode == "old_policy")


def free_routing_mismatch(run: Run, shard: Shard) -> dict[str, float]:
    """R3: what the replay removes, measured on one mini-batch by a forward WITHOUT replay.

    Before any update (the weights that generated the batch): `moe/logprob_gap_no_replay` (mean
    |actor - engine| log-prob) and `moe/mismatch_kl_k3_no_replay` (as rollout_corr/kl_k3), next
    to the replayed passes' rollout/train_logprob_abs_diff and rollout_corr/kl_k3; this pass is
    also the one moe/router_disagreement comes from. Costs one forward of the mini-batch.
    """
    batch = shard.batch
    free, _ = run.actor.compute_log_probs(batch, run.cfg.rollout.temperature, response_only=True)
    mask = batch.response_mask.to(free.device)
    log_ratio = (free - shard.rollout_log_probs.to(free.device))[mask].double().clamp(-20.0, 20.0)
    sums = torch.tensor([float(log_ratio.abs().sum()), float((log_ratio.exp() - 1 - log_ratio).sum()),
                         float(mask.sum())], dtype=torch.float64)  # CPU: the control plane
    dist.all_reduce(sums, group=run.dims.dp_group)
    tokens = max(float(sums[2]), 1.0)
    return {"moe/logprob_gap_no_replay": float(sums[0]) / tokens, "moe/mismatch_kl_k3_no_replay": float(sums[1]) / tokens}


def compute_ref_log_probs(run: Run, shards: list[Shard]) -> None:
    """Fill each mini-batch's ref_log_probs with the frozen starting policy's (KL loss), in place."""
    for shard in shards:
        shard.batch.ref_log_probs = run.reference.compute_log_probs(shard.batch, run.cfg.rollout.temperature)


def add_teacher_advantages(run: Run, shards: list[Shard]) -> dict[str, float]:
    """On-policy distillation: the teacher's log-probs of every policy token, its reverse-KL advantage.

    Each mini-batch's advantages become reward_weight x A_task - coef x (log pi_s - log pi_T)
    on the policy tokens (algo/distill.py), log pi_s the engine's sampling log-probs; returns
    distill/reverse_kl and distill/teacher_logprob, token means over the data-parallel ranks.
    """
    d = run.cfg.algorithm.distill
    sums = torch.zeros(3, dtype=torch.float64)  # CPU: the control plane
    for shard in shards:
        batch = shard.batch
        teacher = run.teacher.compute_log_probs(batch, run.cfg.rollout.temperature).cpu()
        batch.advantages, local = distill_advantages(batch.advantages, shard.rollout_log_probs, teacher,
                                                     batch.response_mask, coef=d.coef, reward_weight=d.reward_weight)
        sums += local
    dist.all_reduce(sums, group=run.dims.dp_group)
    tokens = max(float(sums[2]), 1.0)
    return {"distill/reverse_kl": float(sums[0]) / tokens, "distill/teacher_logprob": float(sums[1]) / tokens}


def rollout_mismatch(run: Run, shards: list[Shard], *, correct: bool) -> dict[str, float]:
    """The engine's log-probs against the actor's old log-probs on the same tokens.

    Always measured: `rollout/train_logprob_abs_diff` (a broken weight sync or a sampling
    mismatch shows here first) and the `rollout_corr/*` mismatch metrics. With `correct`
    (before the update, old log-probs recomputed) the configured rollout correction is
    applied too: IS weights and the rejection mask go into each mini-batch
    (algo/rollout_correction.py).
    """
    rc = run.cfg.algorithm.rollout_correction
    rs_lower, rs_upper = rc.rs_bounds
    diff_sum, num_tokens = 0.0, 0
    sums = torch.zeros(len(CorrectionStats.__slots__), dtype=torch.float64)
    weight_max = 0.0
    for shard in shards:
        batch, old = shard.batch, shard.batch.old_log_probs
        # The engine's log-probs arrive on CPU; the actor's live on its device.
        mask = batch.response_mask.to(old.device)
        rollout = shard.rollout_log_probs.to(old.device)
        diff_sum += float((old - rollout).abs()[mask].sum())
        num_tokens += int(mask.sum())
        weights, keep, stats = rollout_correction(
            old, rollout, mask, is_level=rc.rollout_is if correct else None, is_threshold=rc.rollout_is_threshold,
            rs_level=rc.rollout_rs if correct else None, rs_upper=rs_upper, rs_lower=rs_lower)
        if correct:
            batch.is_weights = None if weights is None else weights.to(batch.response_mask.device)
            batch.response_mask = keep.to(batch.response_mask.device)
        sums += stats.as_tensor()
        weight_max = max(weight_max, stats.weight_max)
    # CPU tensors: the control plane (DESIGN.md, "Where tensors live").
    totals = torch.cat([torch.tensor([diff_sum, float(num_tokens)], dtype=torch.float64), sums])
    peak = torch.tensor([weight_max], dtype=torch.float64)
    dist.all_reduce(totals, group=run.dims.dp_group)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=run.dims.dp_group)
    return {"rollout/train_logprob_abs_diff": float(totals[0] / totals[1].clamp(min=1)),
            **CorrectionStats.metrics(totals[2:], float(peak))}


def validate(run: Run) -> dict[str, float]:
    """avg@k on the held-out prompts (controller); other ranks return {}."""
    if not run.dims.is_controller or not run.val_prompts:
        return {}
    return score_heldout(run.val_prompts, rollout=run.rollout, rewards=run.rewards, tokenizer=run.tokenizer,
                         params=run.val_sampling, episodes=run.collect_settings.episodes)


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the optimizer steps of an RL step."""
    if not rows:
        return {}
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}

