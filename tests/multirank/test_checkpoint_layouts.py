"""Training checkpoints across layouts, on real megatron-core with gloo.

A tiny GPTModel + DDP + distributed optimizer is trained for a few steps at TP=2 and saved;
the checkpoint then loads at TP=1 and at PP=2 with identical logits, and the restored
optimizer makes the same next step as the uninterrupted run. Same layout: save after two
steps, continue; restore from that checkpoint, continue: identical weights and losses
(RNG states included, because dropout is on).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

pytestmark = pytest.mark.multirank

VOCAB, SEQ, HIDDEN, LAYERS = 64, 8, 32, 2


def _build(tp: int, pp: int, dropout: float = 0.0, dtype: torch.dtype = torch.float32, seed: int = 7):
    """Model chunk, optimizer and scheduler on this rank; the actor is not used so the
    checkpoint layer is tested on bare megatron-core objects."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    from megatron_dapo import parallel

    dims = parallel.initialize_model_parallel(tp, pp, seed=seed)
    cfg = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        add_qkv_bias=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        normalization="RMSNorm",
        hidden_dropout=dropout,
        attention_dropout=dropout,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        sequence_parallel=False,
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=dims.is_first_stage,
        post_process=dims.is_last_stage,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    ddp = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False), model
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            min_lr=1e-3,
            use_distributed_optimizer=True,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
        ),
        [ddp],
    )
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    return dims, ddp, opt, sched


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)


def _train_step(ddp, opt, sched, step: int) -> float:
    """One step on a fixed batch through megatron's pipeline schedule; returns the loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens, pos = _batch(step)
    labels = torch.roll(tokens, -1, dims=1)

    def forward_step(data_iter, model):
        out = model(tokens, pos, None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=[ddp],
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=2,
        forward_only=False,
    )
    ok, _, _ = opt.step()
    assert ok
    sched.step(increment=1)
    return float(losses[0]["loss"]) if losses else float("nan")


def _logits(ddp, dims) -> torch.Tensor | None:
    """Full-vocab logits [2, SEQ, V] of a fixed input on the last stage (None elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tokens, pos = _batch(999)
    out: list[torch.Tensor] = []

    def forward_step(data_iter, model):
        logits = model(tokens, pos, None)

        def collect(output):
            out.append(gather_from_tensor_model_parallel_region(output).detach().clone())
            return output.sum() * 0, {}

        return logits, collect

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[ddp],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=2,
            forward_only=True,
        )
    return out[0] if dims.is_last_stage else None


def _full_params(ddp) -> dict[str, torch.Tensor]:
    """This rank's parameter shards by name (for exact comparisons within one layout)."""
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _save_tp2(root: str) -> dict:
    from megatron_dapo.checkpoint import CheckpointManager

    dims, ddp, opt, sched = _build(tp=2, pp=1)
    mgr = CheckpointManager(root, keep_last=2)
    for step in range(2):
        _train_step(ddp, opt, sched, step)
    mgr.save(2, [ddp], opt, sched, {"step": 2, "consumed": 16}, {"trainer": {"seed": 7}})
    logits = _logits(ddp, dims)
    next_loss = _train_step(ddp, opt, sched, 2)
    after = _logits(ddp, dims)
    return {"logits": logits, "after": after, "next_loss": next_loss, "lr": opt.param_groups[0]["lr"]}


def _load_other_layout(root: str, tp: int, pp: int) -> dict:
    from megatron_dapo.checkpoint import CheckpointManager

    dims, ddp, opt, sched = _build(tp=tp, pp=pp)
    mgr = CheckpointManager(root, keep_last=2)
    state = mgr.load(mgr.latest(), [ddp], opt, sched)
    logits = _logits(ddp, dims)
    next_loss = _train_step(ddp, opt, sched, 2)
    after = _logits(ddp, dims)
    return {
        "state": state,
        "logits": logits,
        "after": after,
        "next_loss": next_loss,
        "lr": opt.param_groups[0]["lr"],
    }


def test_tp2_checkpoint_loads_at_tp1_and_pp2_with_equal_logits_and_next_step() -> None:
    with tempfile.TemporaryDirectory() as root:
        saved = run_distributed(_save_tp2, 2, root)[0]
        assert sorted(os.listdir(root)) == ["latest", "step_2"]
        assert Path(root, "latest").read_text() == "step_2\n"

        tp1 = run_distributed(_load_other_layout, 1, root, 1, 1)[0]
        assert tp1["state"] == {"step": 2, "consumed": 16}
        torch.testing.assert_close(tp1["logits"], saved["logits"], rtol=1e-5, atol=1e-5)
        # Optimizer moments and lr schedule came back: the next step moves the weights identically.
        torch.testing.assert_close(tp1["after"], saved["after"], rtol=1e-4, atol=1e-5)
        assert tp1["lr"] == saved["lr"]

        pp2 = run_distributed(_load_other_layout, 2, root, 1, 2)
        last = pp2[1]
        assert pp2[0]["logits"] is None
        torch.testing.assert_close(last["logits"], saved["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last["after"], saved["after"], rtol=1e-4, atol=1e-5)


def _resume_exactness(root: str) -> dict:
    """Dropout on: only restored RNG states make the continued run repeat itself. Uses the
    dp_reshardable optimizer format (the other test covers fully_reshardable)."""
    from megatron_dapo.checkpoint import CheckpointManager

    _, ddp, opt, sched = _build(tp=2, pp=1, dropout=0.1)
    mgr = CheckpointManager(root, keep_last=1, optimizer_sharding="dp_reshardable")
    for step in range(2):
        _train_step(ddp, opt, sched, step)
    mgr.save(2, [ddp], opt, sched, {"step": 2}, {})
    straight = [_train_step(ddp, opt, sched, s) for s in range(2, 4)]
    straight_params = _full_params(ddp)
    straight_rand = torch.rand(3)

    # A fresh process state: rebuild (new init, new RNG draws), then restore.
    _, ddp, opt, sched = _build(tp=2, pp=1, dropout=0.1)
    _train_step(ddp, opt, sched, 77)
    state = mgr.load(mgr.latest(), [ddp], opt, sched)
    resumed = [_train_step(ddp, opt, sched, s) for s in range(state["step"], 4)]
    resumed_params = _full_params(ddp)
    return {
        "straight": straight,
        "resumed": resumed,
        "params_equal": all(torch.equal(straight_params[k], resumed_params[k]) for k in straight_params),
        "rand_equal": torch.equal(straight_rand, torch.rand(3)),
    }


def test_restore_and_continue_is_bit_identical_with_dropout() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_resume_exactness, 2, root)
    for r in results:
        assert r["resumed"] == r["straight"]
        assert r["params_equal"] is True
        assert r["rand_equal"] is True


def _initial_checkpoint(root: str) -> dict:
    """A model-only checkpoint (what HF conversion writes) as the start of bf16 training."""
    from megatron_dapo.checkpoint import CheckpointManager, save_model_checkpoint

    _, ddp, _, _ = _build(tp=2, pp=1, dtype=torch.bfloat16)
    save_model_checkpoint(Path(root) / "init", [ddp], model_family="tiny")
    saved = _full_params(ddp)
    # A new random init; its optimizer already holds fp32 copies of those random weights.
    _, ddp, opt, sched = _build(tp=2, pp=1, dtype=torch.bfloat16, seed=8)
    fresh_differs = any(not torch.equal(p, saved[n]) for n, p in _full_params(ddp).items())
    state = CheckpointManager(root).load(Path(root) / "init", [ddp], opt, sched, model_family="tiny")
    # The warm-up's first lr is 0: the step only writes the fp32 main params back to the model.
    _train_step(ddp, opt, sched, 0)
    after = _full_params(ddp)
    return {
        "state": state,
        "fresh_differs": fresh_differs,
        "kept": all(torch.equal(after[n], saved[n]) for n in saved),
        "dtype": str(next(iter(after.values())).dtype),
    }


def test_model_only_checkpoint_starts_bf16_training_from_its_weights() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_initial_checkpoint, 2, root)
        manifest = json.loads(Path(root, "init", "manifest.json").read_text())
    assert manifest["has_optimizer"] is False and manifest["params_dtype"] == "bfloat16"
    for r in results:
        assert r == {"state": {}, "fresh_differs": True, "kept": True, "dtype": "torch.bfloat16"}
