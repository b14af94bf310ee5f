"""The Megatron actor: old log-probs (step 5) and the DAPO update (step 6) on any TP x PP x DP layout.

`MegatronActor` owns this rank's pipeline stage of a GPTModel (built and loaded by a
model adapter), wrapped in megatron-core's DistributedDataParallel, the (distributed)
Megatron optimizer and a linear-warm-up-then-constant learning rate. Every rank calls
the same methods with its data-parallel share of the batch (all TP and PP ranks of one
data-parallel replica pass the same sequences).

Global token-mean. DAPO's loss is the sum of per-token losses over the whole mini-batch
divided by the number of those tokens. Megatron-core 0.16 normalises in two places, and
both are undone so that the summed gradient is exactly that of the whole-batch loss:
- the pipeline schedules divide a loss function's `(loss, reduced)` result by the number
  of micro-batches (and multiply it by the context-parallel size) in forward_step_calc_loss;
- DDP pre-scales gradients by 1 / (dp x cp) before summing them over data-parallel ranks
  (calculate_per_token_loss=False, average_in_collective=False).
(Under context parallelism the schedule's x cp and DDP's 1 / cp cancel: every CP rank
computes the whole loss from log-probs gathered over the CP group, whose backward keeps
only that rank's positions; actor/context_parallel.py.)
So each micro-batch returns `(local loss sum / global count) x num_microbatches x dp`,
where the global valid-token count (and sequence count, for the seq-* modes) is summed
over micro-batches and all-reduced over data-parallel ranks before the step. Megatron's
own per-token mode (calculate_per_token_loss) would also do token-mean, but it divides
the gradient by a token count only, so it cannot express the seq-* modes or a KL/entropy
term with its own normaliser; the explicit scale covers all of them in one rule.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_dapo.actor.context_parallel import (
    cp_pad_multiple,
    cp_positions,
    gather_over_cp,
    microbatch_loss_scale,
    split_sequence,
)
from megatron_dapo.actor.logprobs import (
    log_probs_and_entropy,
    log_probs_from_logits,
    te_parallel_cross_entropy_fn,
    triton_log_probs_fn,
)
from megatron_dapo.actor.microbatch import MicroBatch, RolloutBatch, build_microbatch, pack_microbatches
from megatron_dapo.actor.moe_metrics import RouterStats
from megatron_dapo.actor.routing_replay import RouteReplay
from megatron_dapo.actor.settings import LRSchedule, make_optimizer_config
from megatron_dapo.actor.shared_layout import build_shared_microbatch, prompt_groups, uses_shared_prompts
from megatron_dapo.algo.objective import LossSettings, objective_metrics, policy_objective
from megatron_dapo.config.model import LoraConfig
from megatron_dapo.lora import add_adapters
from megatron_dapo.models import ModelAdapter, unwrap_model
from megatron_dapo.models.shared_prompts import token_positions
from megatron_dapo.models.transformer_impl import te_available
from megatron_dapo.parallel import ParallelDims

__all__ = ["LRSchedule", "MegatronActor", "make_optimizer_config"]



class MegatronActor:
    """One pipeline stage of the policy with DDP, the Megatron optimizer and an lr schedule.

    Args:
        adapter: the model family's adapter (builds the GPTModel, loads HF weights).
        dims: this rank's layout.
        optimizer_config: megatron-core OptimizerConfig (make_optimizer_config); its
            params_dtype is the model dtype.
        lr_warmup_steps: linear warm-up steps of the learning rate.
        lr_decay: (style, decay_steps, min_lr_ratio) of the decay after warm-up (LRSchedule);
            None = constant.
        hf_checkpoint: HF checkpoint directory to load; None keeps the random init.
        recompute: activation recompute, "none" | "full" | "selective".
        max_tokens_per_microbatch: token budget of one micro-batch (trainer.max_tokens_per_microbatch).
        logprob_chunk_size: tokens per chunk of the log-prob/entropy computation.
        packed: thd-packed micro-batches without padding (needs TE attention on CUDA);
            None = packed exactly when TE is usable.
        shared_prompts: on CPU with CP 1, use the shared-prompt layout (actor/shared_layout.py,
            `uses_shared_prompts`): each prompt goes through the model once per micro-batch
            for all its responses.
        overlap_grad_reduce: reduce-scatter each gradient bucket while the backward of the
            last micro-batch goes on; None = on CUDA with DP > 1 (gloo on CPU gains nothing).
        sequence_parallel: Megatron sequence parallelism (dims.tp > 1); micro-batches are
            then padded to a multiple of the TP size.
        cp_comm_type: how context-parallel attention exchanges K/V (dims.cp > 1).
        routing_replay: algorithm.routing_replay ("off" | "rollout" | "old_policy"); the passes
            choose per call whether they replay (actor/routing_replay.py), this only refuses
            what cannot replay.
        use_te: the Transformer Engine layer spec (models/transformer_impl.choose_transformer_impl of
            model.transformer_impl); None = where it imports next to a GPU.
        lora: model.lora; with rank > 0 the base weights are frozen and only adapters on its
            target linears are trained (megatron_dapo/lora); None or rank 0 = full-parameter.
        seed: trainer.seed, from which the adapters are initialised.
    """

    def __init__(
        self,
        *,
        adapter: ModelAdapter,
        dims: ParallelDims,
        optimizer_config: OptimizerConfig,
        lr_warmup_steps: int = 0,
        lr_decay: tuple[str, int, float] | None = None,
        hf_checkpoint: str | Path | None = None,
        recompute: str = "none",
        max_tokens_per_microbatch: int = 16384,
        logprob_chunk_size: int = 1024,
        packed: bool | None = None,
        shared_prompts: bool = True,
        overlap_grad_reduce: bool | None = None,
        sequence_parallel: bool = False,
        cp_comm_type: str = "p2p",
        routing_replay: str = "off",
        use_te: bool | None = None,
        lora: LoraConfig | None = None,
        seed: int = 0,
    ) -> None:
        use_te = te_available() if use_te is None else use_te
        if dims.cp > 1 and not use_te:
            raise ValueError(f"context parallelism (cp={dims.cp}) needs Transformer Engine attention on CUDA; "
                             "install transformer_engine or set parallel.context_parallel_size=1")
        if packed is None:
            # CP splits padded [n, S] rows (megatron's sbhd load balancing); thd + CP is not wired.
            packed = use_te and dims.cp == 1
        if packed and not use_te:
            raise ValueError("packed=True needs Transformer Engine attention on CUDA (thd format); "
                             "use packed=False (padded micro-batches) on this machine")
        if packed and dims.cp > 1:
            raise ValueError("packed (thd) micro-batches are not supported with context parallelism; "
                             "use packed=False")
        if max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch={max_tokens_per_microbatch} must be >= 1")
        if sequence_parallel and dims.tp == 1:
            raise ValueError("sequence_parallel=True needs tensor parallelism (dims.tp > 1); "
                             "set parallel.sequence_parallel=false")
        if adapter.hf.is_moe and dims.tp > 1 and not sequence_parallel:
            # megatron-core 0.16.1's MoELayer.forward raises in training with TP > 1 and no SP.
            raise ValueError(f"a mixture-of-experts model at tensor_model_parallel_size={dims.tp} needs "
                             "sequence parallelism: set parallel.sequence_parallel=true")
        if routing_replay != "off" and not adapter.hf.is_moe:
            raise ValueError(f"algorithm.routing_replay={routing_replay} needs a mixture-of-experts model; "
                             "set algorithm.routing_replay=off")
        self.adapter = adapter
        self.dims = dims
        self.packed = packed
        self.shared_prompts = uses_shared_prompts(requested=shared_prompts, packed=packed, use_te=use_te,
                                                  cp=dims.cp, device_type=dims.device.type)
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.logprob_chunk_size = logprob_chunk_size
        self.vocab_size = adapter.hf.vocab_size
        # CP cuts every sequence into 2 x cp chunks, SP scatters each over TP ranks.
        self.seq_multiple = cp_pad_multiple(dims.cp, dims.tp, sequence_parallel)

        # No random init when a checkpoint overwrites every weight; build_model marks the
        # TP shards (which the optimizer's grad norm relies on) either way.
        # What a second model of the same layout (the frozen reference) is built with.
        self.model_build_kwargs = {"dtype": optimizer_config.params_dtype, "use_te": use_te,
                                   "sequence_parallel": sequence_parallel, "cp_comm_type": cp_comm_type,
                                   "routing_replay": routing_replay != "off"}
        model = adapter.build_model(dims, recompute=recompute, init_weights=hf_checkpoint is None,
                                    **self.model_build_kwargs)
        if hf_checkpoint is not None:
            adapter.load_hf(model, hf_checkpoint, dims)  # before the optimizer copies fp32 masters
        # Adapters after the base is loaded and before DDP and the optimizer, which then hold them alone.
        self.lora = add_adapters(model, lora, adapter.hf, dims, use_te=use_te, seed=seed, base=hf_checkpoint) \
            if lora is not None and lora.enabled else None
        config = model.config
        if config.calculate_per_token_loss:
            raise ValueError("the model config has calculate_per_token_loss=True; the actor normalises the "
                             "loss itself (global token-mean), build the model with it False")
        # Micro-batches differ in shape: the pipeline must send shapes before tensors.
        config.variable_seq_lengths = dims.pp > 1
        config.finalize_model_grads_func = finalize_model_grads
        if overlap_grad_reduce is None:
            overlap_grad_reduce = dims.device.type == "cuda" and dims.dp > 1
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=optimizer_config.use_distributed_optimizer,
        )
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        if overlap_grad_reduce:
            # As Megatron-LM's training loop: micro-batches before the last accumulate without
            # communication, and the pipeline schedule starts each bucket's reduction.
            config.no_sync_func = self.model.no_sync
            config.grad_sync_func = self.model.start_grad_sync
        self.optimizer = get_megatron_optimizer(optimizer_config, [self.model])
        if optimizer_config.fp16:
            config.grad_scale_func = self.optimizer.scale_loss
        style, decay_steps, min_lr_ratio = lr_decay or ("constant", 0, 0.0)
        self.scheduler = LRSchedule(lr=optimizer_config.lr, warmup_steps=lr_warmup_steps, decay_style=style,
                                    decay_steps=decay_steps, min_lr_ratio=min_lr_ratio)
        self.weight_decay = optimizer_config.weight_decay
        hf = adapter.hf
        self.router_stats = RouterStats(self.model, num_layers=hf.num_layers, num_experts=hf.num_experts,
                                        device=dims.device) if hf.is_moe else None
        self.route_replay = RouteReplay(self.model, moe_layers=hf.moe_layers, top_k=hf.num_experts_per_tok,
                                        dims=dims, sequence_parallel=sequence_parallel) if hf.is_moe else None
        self._recorded_routes: torch.Tensor | None = None

    def _routes_pass(self, *, replay: bool, record: bool, compare: bool = True) -> contextlib.AbstractContextManager:
        """Routing replay/recording and route metrics for one pass (an MoE actor; nothing otherwise)."""
        if self.route_replay is None:
            if replay or record:
                raise ValueError("routing replay needs a mixture-of-experts model")
            return contextlib.nullcontext()
        # The router's own choice is compared with the engine's only in a pass that does not replay.
        return self.route_replay.pass_(replay=replay, record=record, compare=compare and not replay)

    def route_metrics(self) -> dict[str, float]:
        """Collective over every rank: moe/router_disagreement and moe/replay_route_mismatch since
        the last call ({} for a dense model or a batch without routes)."""
        return self.route_replay.metrics() if self.route_replay is not None else {}

    # ------------------------------------------------------------------ micro-batching

    def _microbatches(self, batch: RolloutBatch) -> list[MicroBatch]:
        """Token-budget micro-batches, as many on this rank as on the busiest DP rank."""
        lengths = batch.seq_lens.tolist()
        shared = self.shared_prompts
        layout = {"padded": not (self.packed or shared), "prompts": prompt_groups(batch) if shared else None}
        local = pack_microbatches(lengths, self.max_tokens_per_microbatch, **layout)
        count = torch.tensor([len(local)], device=self.dims.device)
        if self.dims.dp > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.dims.dp_group)
        plan = pack_microbatches(lengths, self.max_tokens_per_microbatch, num_microbatches=int(count), **layout)
        on_device = _to_device(batch, self.dims.device)
        if shared:
            return [build_shared_microbatch(on_device, idx, pad_to_multiple=self.seq_multiple,
                                            prompts=layout["prompts"]) for idx in plan]
        return [build_microbatch(on_device, idx, packed=self.packed, pad_to_multiple=self.seq_multiple)
                for idx in plan]

    def _run(self, microbatches: list[MicroBatch], loss_func: Any, forward_only: bool,
             model: Any | None = None) -> list[Any]:
        """Megatron's schedule over the micro-batches; returns the last stage's loss-function outputs.

        `model` replaces the actor's own model (a frozen model of the same layout, forward only).
        """

        def forward_step(data_iterator: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data_iterator)
            input_ids, position_ids = mb.input_ids, mb.position_ids
            if self.dims.cp > 1:  # this rank's load-balanced chunks; RoPE slices the same ones
                held = cp_positions(input_ids.shape[1], self.dims.cp, self.dims.cp_rank)
                input_ids, position_ids = split_sequence(input_ids, held), split_sequence(position_ids, held)
            replay = self.route_replay if own_model else None
            if replay is not None:
                replay.prepare(mb)
            with token_positions(unwrap_model(model), position_ids[0] if mb.shared is not None else None):
                output = model(input_ids, position_ids, None, packed_seq_params=mb.packed_seq_params())
            if replay is not None and replay.recorded is not None and mb.indices:
                rows = replay.recorded_rows(mb).to(torch.int16)  # [n, S_mb, L, k]
                cols = min(rows.shape[1], self._recorded_routes.shape[1])  # SP may pad past the batch
                self._recorded_routes[torch.as_tensor(mb.indices), :cols] = rows[:, :cols].cpu()
            return output, partial(loss_func, mb)

        first = microbatches[0].input_ids
        own_model = model is None
        chunk = model if model is not None else self.model
        return get_forward_backward_func(pp_size=self.dims.pp)(
            forward_step_func=forward_step, data_iterator=iter(microbatches), model=[chunk],
            num_microbatches=len(microbatches), seq_length=first.shape[1], micro_batch_size=first.shape[0],
            forward_only=forward_only, collect_non_loss_data=forward_only,
        )

    def _token_stats(self, mb: MicroBatch, output: torch.Tensor, temperature: float,
                     entropy_grad: bool, response_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob and entropy rows [n, S] of a micro-batch from its vocab-parallel logits.

        With response_only (CP 1), only the positions of mb.loss_mask are computed (0
        elsewhere): prompt and padding positions, most of a short-response batch, would each
        cost a softmax over the vocabulary (and its backward) for values nothing reads.
        """
        logits = output.reshape(-1, output.shape[-1])  # [n*S/cp or sum L (+ SP padding), V/tp]
        targets = mb.targets  # shifted on whole sequences, then split like the inputs
        cp = self.dims.cp
        if cp > 1:
            targets = split_sequence(targets, cp_positions(targets.shape[1], cp, self.dims.cp_rank))
        local_shape = targets.shape
        targets = targets.reshape(-1)
        if mb.source_index is not None:  # shared prompts: gather each row position's model output
            wanted = (mb.loss_mask if response_only else mb.valid).reshape(-1)
            keep = torch.nonzero(wanted).squeeze(-1)
            source = mb.source_index.reshape(-1).index_select(0, keep)
            log_prob, entropy = self._stats(logits.index_select(0, source), targets[keep], temperature, entropy_grad)
            rows = targets.numel()
            return (log_prob.new_zeros(rows).index_copy(0, keep, log_prob).view(local_shape),
                    entropy.new_zeros(rows).index_copy(0, keep, entropy).view(local_shape))
        if mb.flat_index is not None:
            targets = targets[mb.flat_index]
            logits = logits[: targets.numel()]  # the packed padding after the real tokens predicts nothing
        if response_only and cp == 1:
            wanted = mb.loss_mask.reshape(-1)
            if mb.flat_index is not None:
                wanted = wanted[mb.flat_index]
            # Every TP rank holds the same mask, so all take part in the same collectives.
            keep = torch.nonzero(wanted).squeeze(-1)  # [k]
            log_prob, entropy = self._stats(logits.index_select(0, keep), targets[keep], temperature, entropy_grad)
            num_positions = logits.shape[0]
            log_prob = log_prob.new_zeros(num_positions).index_copy(0, keep, log_prob)
            entropy = entropy.new_zeros(num_positions).index_copy(0, keep, entropy)
        else:
            log_prob, entropy = self._stats(logits, targets, temperature, entropy_grad)
        if cp > 1:
            return (gather_over_cp(log_prob.view(local_shape), self.dims.cp_group, cp),
                    gather_over_cp(entropy.view(local_shape), self.dims.cp_group, cp))
        return mb.to_rows(log_prob), mb.to_rows(entropy)

    def _stats(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
               entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(target) [T] and entropy [T] from logits [T, V/tp]."""
        tp_group = self.dims.tp_group if self.dims.tp > 1 else None
        kwargs = {"temperature": temperature, "tp_group": tp_group, "chunk_size": self.logprob_chunk_size,
                  "vocab_size": self.vocab_size}
        fused_both = logits.is_cuda and triton_log_probs_fn() is not None
        # No rows (a micro-batch without response tokens) stays off TE's kernel, which
        # cannot take an empty input; the chunked path and the Triton kernel handle one.
        if (not fused_both and not entropy_grad and torch.is_grad_enabled() and te_parallel_cross_entropy_fn()
                and logits.is_cuda and logits.shape[0] > 0):
            # TE's kernel gives log-probs with gradient; entropy is then only a metric (a second
            # pass). The Triton kernel, where available, gives both in one pass instead.
            log_prob = log_probs_from_logits(logits, targets, **kwargs)
            with torch.no_grad():
                entropy = log_probs_and_entropy(logits.detach(), targets, **kwargs)[1]
        else:
            log_prob, entropy = log_probs_and_entropy(logits, targets, **kwargs)
        return log_prob, entropy

    # ----------------------------------------------------------------------- step 5

    def compute_log_probs(self, batch: RolloutBatch, temperature: float, model: Any | None = None, *,
                          response_only: bool = False, replay: bool = False,
                          record_routes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of this rank's sequences under the current weights (forward only).

        Collective over the model-parallel and data-parallel groups; the result is
        broadcast from the last pipeline stage, so every rank of the replica returns it.

        Args:
            batch: this data-parallel rank's sequences (old_log_probs/advantages unused).
            temperature: the rollout temperature; probabilities are softmax(logits / temperature).
            model: another model of this actor's layout to run instead (the frozen reference).
            response_only: compute only where batch.response_mask is set (0 elsewhere), all
                that step 5 needs.
            replay: the MoE routers use batch.replay_routes (routing replay).
            record_routes: the routes this pass used become batch.replay_routes ([B, S, L, k]
                int16 on every rank of the replica; R2 replays them in the update).

        Returns:
            (log_probs [B, S], entropy [B, S]) fp32 on dims.device, aligned with
            batch.input_ids: [b, t] is log p(token t | tokens < t) and the entropy of that
            distribution; 0 at t = 0 and on padding.
        """
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} (rollout.temperature) must be > 0")
        microbatches = self._microbatches(batch)
        num_seqs, width = batch.input_ids.shape
        out = torch.zeros(2, num_seqs, width, dtype=torch.float32, device=self.dims.device)

        def keep(mb: MicroBatch, output: torch.Tensor, non_loss_data: bool = True) -> None:
            log_prob, entropy = self._token_stats(mb, output, temperature, entropy_grad=False,
                                                  response_only=response_only)
            _scatter_rows(out[0], mb, log_prob)
            _scatter_rows(out[1], mb, entropy)

        (model if model is not None else self.model).eval()
        if record_routes:
            hf = self.adapter.hf
            self._recorded_routes = torch.full((num_seqs, width, len(hf.moe_layers), hf.num_experts_per_tok), -1,
                                               dtype=torch.int16)
        passes = self._routes_pass(replay=replay, record=record_routes) if model is None else contextlib.nullcontext()
        with torch.no_grad(), passes:
            self._run(microbatches, keep, forward_only=True, model=model)
        if self.dims.pp > 1:
            dist.broadcast(out, src=self.dims.pp_global_ranks[-1], group=self.dims.pp_group)
        if record_routes:
            batch.replay_routes = self.route_replay.merge_recorded(self._recorded_routes)
            self._recorded_routes = None
        return out[0], out[1]

    # ----------------------------------------------------------------------- step 6

    def train_step(self, batch: RolloutBatch, loss: LossSettings, *, old_from_forward: bool = False,
                   replay: bool = False) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch with the DAPO loss.

        Collective over all ranks. The loss of every micro-batch is its local sum over the
        mini-batch's global counts, so the gradient equals that of the whole mini-batch's
        loss for any micro-batch budget and any TP/PP/DP layout.

        Args:
            batch: this data-parallel rank's sequences with old_log_probs and advantages
                (and ref_log_probs when loss.use_kl_loss).
            loss: the loss settings.
            old_from_forward: the current weights ARE the old policy (the only update of an
                RL step): the ratio uses the detached log-probs of this forward pass, so it is
                exactly 1 and batch.old_log_probs must be None. They are written to
                batch.old_log_probs afterwards ([B, S], aligned like compute_log_probs'
                result, on every rank of the replica), for metrics.
            replay: the MoE routers use batch.replay_routes (routing replay).

        Returns:
            verl-named metrics, identical on every rank: actor/pg_loss, actor/pg_clipfrac,
            actor/pg_clipfrac_lower, actor/ppo_kl, actor/entropy (token-mean over the
            mini-batch), actor/grad_norm (before clipping), actor/lr, and actor/kl_loss when
            the KL loss is on; for an MoE model the moe/* routing metrics (actor/moe_metrics.py).
        """
        if batch.advantages is None:
            raise ValueError("train_step needs batch.advantages; compute advantages before the update")
        if old_from_forward and batch.old_log_probs is not None:
            raise ValueError("old_from_forward=True takes the old log-probs from this forward pass, but "
                             "batch.old_log_probs is set; pass one or the other")
        if not old_from_forward and batch.old_log_probs is None:
            raise ValueError("train_step needs batch.old_log_probs; compute them with compute_log_probs (step 5), "
                             "or pass old_from_forward=True for the only update of an RL step")
        if loss.needs_ref_log_probs and batch.ref_log_probs is None:
            raise ValueError("use_kl_loss=True but batch.ref_log_probs is None; compute reference log-probs "
                             "or set algorithm.use_kl_loss=false")
        dims = self.dims
        microbatches = self._microbatches(batch)
        num_mb = len(microbatches)
        valid_mask = [mb.loss_mask for mb in microbatches]
        # [tokens, sequences] of the whole mini-batch.
        counts = torch.stack([
            sum(m.sum() for m in valid_mask), sum(m.any(dim=-1).sum() for m in valid_mask)
        ]).to(torch.int64)
        if dims.dp > 1:
            dist.all_reduce(counts, group=dims.dp_group)
        num_tokens, num_seqs = counts[0], counts[1]
        # Undo the schedule's 1/num_microbatches and DDP's 1/dp (module docstring); with CP
        # every CP rank computes the whole loss from gathered log-probs (actor/context_parallel.py).
        undo_megatron_mean = microbatch_loss_scale(num_mb, dims.dp)
        forward_log_probs = None
        if old_from_forward:
            forward_log_probs = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=dims.device)

        def loss_func(mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # Every term of the loss and every metric reads only loss_mask positions.
            log_prob, entropy = self._token_stats(mb, output, loss.temperature,
                                                  entropy_grad=loss.needs_entropy_grad, response_only=True)
            old_log_prob = mb.old_log_probs
            if forward_log_probs is not None:
                old_log_prob = log_prob.detach()
                _scatter_rows(forward_log_probs, mb, old_log_prob)
            total, reduced = policy_objective(
                log_prob, old_log_prob, mb.advantages, mb.loss_mask, loss, entropy=entropy,
                num_global_tokens=num_tokens, num_global_seqs=num_seqs, ref_log_prob=mb.ref_log_probs,
                is_weights=mb.is_weights)
            return total * undo_megatron_mean, reduced

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        stats = self.router_stats.collecting() if self.router_stats is not None else contextlib.nullcontext()
        # The routers are compared with the engine's only on the weights that generated the batch.
        with stats, self._routes_pass(replay=replay, record=False, compare=old_from_forward):
            outputs = self._run(microbatches, loss_func, forward_only=False)
        sums = torch.zeros(len(loss.metric_names), dtype=torch.float32, device=dims.device)
        if dims.is_last_stage:
            sums = torch.stack(outputs).sum(0)
        if dims.pp > 1:
            dist.broadcast(sums, src=dims.pp_global_ranks[-1], group=dims.pp_group)
            if forward_log_probs is not None:
                dist.broadcast(forward_log_probs, src=dims.pp_global_ranks[-1], group=dims.pp_group)
        if forward_log_probs is not None:
            batch.old_log_probs = forward_log_probs.to(batch.input_ids.device)
        if dims.dp > 1:
            dist.all_reduce(sums, group=dims.dp_group)

        lr = self.scheduler.current()
        for group in self.optimizer.param_groups:
            # megatron-core gives norms and biases wd_mult=0 (and lr_mult) per param group, but
            # only its own scheduler applies them; without this they would be decayed too.
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)
        update_successful, grad_norm, _ = self.optimizer.step()
        if not update_successful:
            # Only fp16 loss scaling skips steps; the schedule does not advance on a skipped step.
            grad_norm = math.nan
        else:
            self.scheduler.num_steps += 1
        metrics = objective_metrics(sums.tolist(), loss)
        metrics["actor/grad_norm"] = float(grad_norm)
        metrics["actor/lr"] = lr
        if self.router_stats is not None:
            metrics.update(self.router_stats.metrics())  # moe/*: actor/moe_metrics.py
        return metrics


def _scatter_rows(out: torch.Tensor, mb: MicroBatch, values: torch.Tensor) -> None:
    """Write a micro-batch's per-position values [n, S'] into its rows of `out` [B, S], aligned like input_ids.

    Row position t predicts token t + 1, so its value lands in column t + 1; positions
    that predict nothing (padding) write 0.
    """
    if not mb.indices:
        return
    rows = torch.as_tensor(mb.indices, device=out.device)
    cols = mb.targets.shape[1]
    width = out.shape[1]
    out[rows, 1:cols + 1] = torch.where(mb.valid, values, 0.0)[:, : width - 1]


def _to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return RolloutBatch(
        input_ids=move(batch.input_ids), seq_lens=move(batch.seq_lens), response_mask=move(batch.response_mask),
        old_log_probs=move(batch.old_log_probs), advantages=move(batch.advantages),
        ref_log_probs=move(batch.ref_log_probs), is_weights=move(batch.is_weights), routes=move(batch.routes),
        replay_routes=move(batch.replay_routes),
    )
