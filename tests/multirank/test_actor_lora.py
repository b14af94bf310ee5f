"""A LoRA actor (megatron_dapo/lora) is the same model at every layout, and trains its adapters only.

The same tiny Qwen2 with rank-4 adapters on all four linears of every layer, one update at
TP 1, TP 2 (adapters' h all-reduced / copied over TP), TP 2 with sequence parallelism (h
gathered and reduce-scattered along the sequence, the replicated factor's gradient all-reduced
with the norms') and PP 2: log-probs before and after, the loss metrics and the merged weights
(W + alpha/r B A, exported as the engines receive them) agree in float32. Two plain SGD steps
(SGD reads the gradient itself, where Adam's first step is nearly sign(g); B = 0 at the start,
so only the second step moves A), then an AdamW step with the distributed optimizer. Every
base weight is bit-equal to the checkpoint's after the updates, and the base with adapters off
(the KL reference) gives the starting log-probs exactly.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint
from test_actor_sequence_parallel import _batch as sp_batch

pytestmark = pytest.mark.multirank

TEMPERATURE = 0.9
SGD_LR = 30.0


def _batch() -> dict[str, torch.Tensor]:
    """test_actor_sequence_parallel's batch (odd lengths, two rows sharing a prompt) without its noise."""
    batch = sp_batch()
    batch.pop("noise")
    return batch


def _worker(tp: int, pp: int, sps: tuple[bool | str, ...], directory: str) -> dict:
    from megatron.core.optimizer import OptimizerConfig

    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch
    from megatron_dapo.actor.reference import BaseOfAdapters
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import LoraConfig, OptimConfig
    from megatron_dapo.models import adapter_for, unwrap_model
    from megatron_dapo.models.hf_checkpoint import HFCheckpoint

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    dims = parallel.initialize_model_parallel(tp, pp, seed=0)
    adapter = adapter_for(directory)
    lora = LoraConfig(rank=4, alpha=8.0)
    loss = LossSettings(clip_ratio_c=3.0, temperature=TEMPERATURE)
    sgd = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=SGD_LR, min_lr=SGD_LR, weight_decay=0.0,
                          clip_grad=0.0, params_dtype=torch.float32, use_distributed_optimizer=False)
    adam = make_optimizer_config(OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0), dtype=torch.float32,
                                 use_distributed_optimizer=True)
    out: dict = {}
    for sp in sps:
        for name, config, steps in (("sgd", sgd, 2), ("adam", adam, 1)):
            # sp "recompute": TP 1 under full activation recompute (the frozen embedding's output
            # must ask for a gradient, or no adapter would train: lora/layers.py).
            actor = MegatronActor(adapter=adapter, dims=dims, optimizer_config=config, hf_checkpoint=directory,
                                  max_tokens_per_microbatch=29, logprob_chunk_size=7, sequence_parallel=sp is True,
                                  recompute="full" if sp == "recompute" else "none", lora=lora, seed=3)
            gpt = unwrap_model(actor.model)
            base = {n: p.detach().clone() for n, p in gpt.named_parameters() if not n.endswith(("lora_A", "lora_B"))}
            trainable = sorted(n for n, p in gpt.named_parameters() if p.requires_grad)
            start, _ = actor.compute_log_probs(RolloutBatch(**_batch()), TEMPERATURE)
            metrics = []
            for _ in range(steps):
                batch = RolloutBatch(**_batch())
                metrics.append(actor.train_step(batch, loss, old_from_forward=True))
            after, _ = actor.compute_log_probs(RolloutBatch(**_batch()), TEMPERATURE)
            reference = BaseOfAdapters(actor).compute_log_probs(RolloutBatch(**_batch()), TEMPERATURE)
            base_kept = all(torch.equal(p, base[n]) for n, p in gpt.named_parameters() if n in base)
            out[(sp, name)] = {"start": start, "after": after, "reference": reference, "metrics": metrics,
                               "merged": dict(adapter.export_hf(actor.model, dims)), "base_kept": base_kept,
                               "trainable": trainable}
    hf = HFCheckpoint(directory)
    out["checkpoint"] = {n: hf.read(n) for n in hf.shapes}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = str(make_tiny_checkpoint(tmp_path_factory.mktemp("lora") / "qwen2", "qwen2", num_layers=2, seed=9,
                                         tie_word_embeddings=True))
    return {
        "tp1": run_distributed(_worker, 1, 1, 1, (False, "recompute"), directory, timeout_s=300)[0],
        "tp2": run_distributed(_worker, 2, 2, 1, (False, True), directory, timeout_s=400),
        "pp2": run_distributed(_worker, 2, 1, 2, (False,), directory, timeout_s=300),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_a_lora_actor_trains_adapters_only_and_its_reference_is_the_base(runs: dict) -> None:
    one = runs["tp1"]
    for key in (("sgd"), ("adam")):
        r = one[(False, key)]
        assert r["base_kept"], "a base weight changed"
        assert r["trainable"] and all(n.endswith(("lora_A", "lora_B")) for n in r["trainable"])
        assert len(r["trainable"]) == 2 * 4 * 2  # A and B of 4 linears in 2 layers
        assert torch.equal(r["reference"], r["start"])  # adapters off: the base, exactly
        assert _rel(r["after"], r["start"]) > 1e-3  # the adapters moved the policy
    sgd = one[(False, "sgd")]
    # The merged export differs from the base exactly on the adapted weights.
    ckpt = one["checkpoint"]
    moved = {n for n, t in sgd["merged"].items() if not torch.equal(t, ckpt[n])}
    assert moved and all(n.endswith(("proj.weight",)) for n in moved), sorted(moved)


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp", "pp2", "recompute"])
def test_a_lora_actor_equals_the_tp1_run_at_every_layout(runs: dict, layout: str) -> None:
    base = runs["tp1"]
    sp = {"tp2-sp": True, "recompute": "recompute"}.get(layout, False)
    for r in ([runs["tp1"]] if layout == "recompute" else runs[layout.removesuffix("-sp")]):
        for name in ("sgd", "adam"):
            want, got = base[(False, name)], r[(sp, name)]
            assert got["base_kept"]
            for key in ("start", "after", "reference"):
                assert _rel(got[key], want[key]) < 1e-5, (name, key)
            for step_want, step_got in zip(want["metrics"], got["metrics"], strict=True):
                for key in ("actor/pg_loss", "actor/grad_norm"):
                    assert step_got[key] == pytest.approx(step_want[key], rel=1e-5, abs=1e-9), (name, key)
            if got["merged"]:  # the controller's view (every rank of an 'all' export)
                err = max(_rel(got["merged"][n], want["merged"][n]) for n in want["merged"])
                assert err < 1e-5, (name, err)
