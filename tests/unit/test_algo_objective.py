"""algo/objective.py: the update's loss is the policy loss, minus the entropy bonus, plus the KL term,
each aggregated like the policy loss over the mini-batch's global counts; metrics in a fixed order."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.algo import OBJECTIVE_METRICS, LossSettings, agg_loss, compute_policy_loss, kl_penalty
from megatron_dapo.algo.objective import objective_metrics, policy_objective


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (3, 7)
    mask = (torch.rand(shape, generator=g) > 0.3).float()
    mask[2] = 0.0  # a sequence with no token in this micro-batch
    return {
        "log_prob": -torch.rand(shape, generator=g, dtype=torch.float64) * 3,
        "old": -torch.rand(shape, generator=g, dtype=torch.float64) * 3,
        "adv": torch.randn(shape[0], 1, generator=g, dtype=torch.float64).expand(shape),
        "mask": mask.double(),
        "entropy": torch.rand(shape, generator=g, dtype=torch.float64),
        "ref": -torch.rand(shape, generator=g, dtype=torch.float64) * 3,
    }


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_objective_is_policy_loss_minus_entropy_plus_kl(mode: str) -> None:
    b = _batch()
    s = LossSettings(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode,
                     entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                     loss_scale_factor=32.0)
    num_tokens, num_seqs = 40, 5  # global counts larger than this micro-batch's
    total, reduced = policy_objective(b["log_prob"], b["old"], b["adv"], b["mask"], s, entropy=b["entropy"],
                                      num_global_tokens=num_tokens, num_global_seqs=num_seqs, ref_log_prob=b["ref"])
    agg = {"loss_agg_mode": mode, "num_global_tokens": num_tokens, "num_global_seqs": num_seqs,
           "loss_scale_factor": 32.0}
    pg, pg_metrics = compute_policy_loss(b["log_prob"], b["old"], b["adv"], b["mask"], 0.2, 0.28, 3.0, **agg)
    ent = agg_loss(b["entropy"], b["mask"], mode, num_tokens, num_seqs, 32.0)
    kl = agg_loss(kl_penalty(b["log_prob"], b["ref"], "low_var_kl"), b["mask"], mode, num_tokens, num_seqs, 32.0)
    assert float(total) == pytest.approx(float(pg - 0.01 * ent + 0.1 * kl), rel=1e-12)
    assert reduced.dtype == torch.float32 and reduced.shape == (len(OBJECTIVE_METRICS),)
    assert float(reduced[0]) == pytest.approx(float(pg), rel=1e-6)
    assert float(reduced[1]) == pytest.approx(float(pg_metrics["pg_clipfrac"]), rel=1e-6)
    # The entropy metric is a global token mean whatever the loss aggregation.
    token_mean = float((b["entropy"] * b["mask"]).sum() / num_tokens)
    assert float(reduced[4]) == pytest.approx(token_mean, rel=1e-6)


def test_metrics_are_named_and_kl_only_when_on() -> None:
    sums = [0.5, 0.1, 0.0, 0.01, 2.0, 0.3]
    off = objective_metrics(sums, LossSettings())
    assert off == {"actor/pg_loss": 0.5, "actor/pg_clipfrac": 0.1, "actor/pg_clipfrac_lower": 0.0,
                   "actor/ppo_kl": 0.01, "actor/entropy": 2.0}
    on = objective_metrics(sums, LossSettings(use_kl_loss=True, kl_loss_coef=0.1))
    assert on["actor/kl_loss"] == 0.3


def test_entropy_gets_a_gradient_only_when_it_is_in_the_loss() -> None:
    assert LossSettings(entropy_coeff=0.0).needs_entropy_grad is False
    assert LossSettings(entropy_coeff=0.01).needs_entropy_grad is True
    assert LossSettings(use_kl_loss=True).needs_ref_log_probs is True
