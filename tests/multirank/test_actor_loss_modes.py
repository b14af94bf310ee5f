"""Where the old log-probs come from, and seq-mean-token-sum-norm's constant divisor, on the real actor.

- old_from_forward (the only update of an RL step): the ratio is exactly 1, so ppo_kl and
  the clip fractions are exactly 0, the step equals the one taken against log-probs from
  a separate forward pass (compute_log_probs), and batch.old_log_probs comes back filled
  with those log-probs; at PP 2 too, where they live on the last stage.
- seq-mean-token-sum-norm from the config divides by a constant: adding a sequence that
  carries no loss but is the longest of the batch leaves the gradient unchanged (with the
  batch's longest length as divisor it shrank by 20/40).
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank

LENGTHS = [20, 17, 15, 12]
PROMPT_LENGTHS = [5, 4, 6, 3]
LONG = 40  # the extra sequence: longest of the batch, no response token
TEMPERATURE = 0.9
SGD_LR = 1e4  # (w0 - w1) / lr reads the gradient at fp32 precision (see test_actor_train_step)


def _batch(extra_long: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    lengths = [*LENGTHS, LONG] if extra_long else LENGTHS
    prompts = [*PROMPT_LENGTHS, LONG] if extra_long else PROMPT_LENGTHS
    width = max(lengths)
    ids = torch.randint(0, 100, (len(LENGTHS), LONG), generator=gen)
    ids = torch.cat([ids, torch.randint(0, 100, (1, LONG), generator=gen)])[: len(lengths), :width]
    pos = torch.arange(width)
    lens = torch.tensor(lengths)
    response = (pos >= torch.tensor(prompts).unsqueeze(1)) & (pos < lens.unsqueeze(1))
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3])[: len(lengths)].unsqueeze(1).expand(-1, width).contiguous()
    return {"input_ids": torch.where(pos < lens.unsqueeze(1), ids, 0), "seq_lens": lens,
            "response_mask": response, "advantages": adv}


def _worker(pp: int, directory: str) -> dict:
    from megatron.core.optimizer import OptimizerConfig

    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import AlgorithmConfig, OptimConfig
    from megatron_dapo.models import adapter_for

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    dims = parallel.initialize_model_parallel(1, pp, seed=0)
    adapter = adapter_for(directory)

    def actor(config: OptimizerConfig) -> MegatronActor:
        return MegatronActor(adapter=adapter, dims=dims, optimizer_config=config, hf_checkpoint=directory,
                             max_tokens_per_microbatch=40, logprob_chunk_size=7)

    def export(a: MegatronActor) -> dict[str, torch.Tensor]:
        return dict(adapter.export_hf(a.model, dims))

    loss = LossSettings(clip_ratio_c=3.0, entropy_coeff=0.01, temperature=TEMPERATURE)
    adam = make_optimizer_config(OptimConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0), dtype=torch.float32,
                                 use_distributed_optimizer=False)
    out: dict = {}
    recompute = actor(adam)
    batch = RolloutBatch(**_batch())
    batch.old_log_probs, _ = recompute.compute_log_probs(batch, TEMPERATURE)
    out["recomputed"] = batch.old_log_probs.clone()
    out["recompute_metrics"] = recompute.train_step(batch, loss)
    out["recompute_weights"] = export(recompute)

    current = actor(adam)
    batch = RolloutBatch(**_batch())
    out["current_metrics"] = current.train_step(batch, loss, old_from_forward=True)
    out["current_weights"] = export(current)
    out["current_old"] = batch.old_log_probs
    out["response_mask"] = batch.response_mask
    with pytest.raises(ValueError, match=r"batch\.old_log_probs is set; pass one or the other"):
        current.train_step(RolloutBatch(**_batch(), old_log_probs=out["recomputed"]), loss, old_from_forward=True)

    sgd = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=SGD_LR, min_lr=SGD_LR, weight_decay=0.0,
                          clip_grad=0.0, params_dtype=torch.float32, use_distributed_optimizer=False)
    norm = LossSettings.from_config(AlgorithmConfig(loss_agg_mode="seq-mean-token-sum-norm", clip_ratio_c=None),
                                    TEMPERATURE, max_response_length=32)
    for extra_long in (False, True):
        a = actor(sgd)
        a.train_step(RolloutBatch(**_batch(extra_long)), norm, old_from_forward=True)
        out[f"sum_norm_weights/{extra_long}"] = export(a)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("modes") / "qwen2", "qwen2", num_layers=2, seed=6))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("pp", [1, 2])
def test_old_log_probs_from_the_update_forward_and_constant_sum_norm(checkpoint: str, pp: int) -> None:
    outs = run_distributed(_worker, pp, pp, checkpoint, timeout_s=300)
    for r in outs:  # every pipeline stage holds the same log-probs and metrics afterwards
        assert r["current_metrics"]["actor/ppo_kl"] == 0.0
        assert r["current_metrics"]["actor/pg_clipfrac"] == 0.0
        assert r["current_metrics"]["actor/pg_clipfrac_lower"] == 0.0
        # The update computes log-probs at response positions only (0 elsewhere).
        on_response = r["response_mask"][:, 1:]  # position t's log-prob sits in column t
        diff = (r["current_old"] - r["recomputed"])[:, 1:]
        assert float(diff[on_response].abs().max()) < 1e-6
        assert float(r["current_old"][:, 1:][~on_response].abs().max()) == 0.0
        assert r["current_metrics"] == outs[0]["current_metrics"]
    r = outs[0]
    # The recomputed log-probs give a ratio of 1 up to fp32 noise: the same step.
    assert abs(r["recompute_metrics"]["actor/ppo_kl"]) < 1e-6
    for name in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert r["current_metrics"][name] == pytest.approx(r["recompute_metrics"][name], rel=1e-5)
    w_err = max(_rel(r["current_weights"][n], r["recompute_weights"][n]) for n in r["recompute_weights"])
    assert w_err < 1e-5
    base, with_long = r["sum_norm_weights/False"], r["sum_norm_weights/True"]
    moved = max(_rel(with_long[n], base[n]) for n in base)
    assert moved < 1e-5, moved
