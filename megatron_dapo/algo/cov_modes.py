"""Clip-Cov and KL-Cov (arXiv 2505.22617), and the token-level PPO clip they share with vanilla.

Both act on the few tokens whose centred covariance cov_t = (A_t - mean A) (log pi_t - mean
log pi) is largest, the tokens that drive entropy collapse:

- clip_cov: the vanilla surrogate (with the dual clip when set); among the tokens that the
  ratio clip left active and whose cov lies in (clip_cov_lb, clip_cov_ub), a random
  max(1, floor(clip_cov_ratio x N)) get no gradient (loss 0).
- kl_cov: -A r, plus ppo_kl_coef x |log r| on the top max(1, floor(kl_cov_ratio x N)) tokens
  by cov; no ratio clip.

N, the means and the choice are those of the micro-batch, as in the paper's code and verl:
the covariance needs the current policy's log-probs, which exist one micro-batch at a time
in a single forward-backward pass. The choice is therefore the one part of any loss mode
that depends on how the mini-batch is cut into micro-batches (DESIGN.md); the normalisation
still uses the mini-batch's global token count. Every rank that computes the same
micro-batch's loss (TP, PP's last stage, all CP ranks) makes the same choice: the inputs
are the same there and the random draw is seeded from them.
"""

from __future__ import annotations

import torch

from megatron_dapo.algo.loss_inputs import LossInputs, ModeResult

__all__ = ["clip_cov_loss", "kl_cov_loss", "ppo_clip"]


def ppo_clip(x: LossInputs, ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clip-Higher surrogate and dual clip: (per-token loss, clip active, dual clip active).

    Strict comparisons: a token counted as clipped is exactly a token without gradient, and a
    ratio on a clip boundary keeps the unclipped gradient.
    """
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * torch.clamp(ratio, min=1.0 - x.clip_ratio_low, max=1.0 + x.clip_ratio_high)
    clip_active = clipped > unclipped
    pg_losses = torch.where(clip_active, clipped, unclipped)
    if x.clip_ratio_c is None:
        return pg_losses, clip_active, torch.zeros_like(clip_active)
    dual_bound = -x.advantages * x.clip_ratio_c
    dual_active = (x.advantages < 0) & (pg_losses > dual_bound)
    return torch.where(dual_active, dual_bound, pg_losses), clip_active, dual_active


def _centered_cov(x: LossInputs) -> torch.Tensor:
    """[B, T] (A - mean A)(log pi - mean log pi) with the micro-batch's token means, detached."""
    adv, logp = x.advantages.detach(), x.log_prob.detach()
    n = x.valid.sum().clamp(min=1).to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    mean_adv = torch.where(x.valid, adv, zero).sum() / n
    mean_logp = torch.where(x.valid, logp, zero).sum() / n
    return (adv - mean_adv) * (logp - mean_logp)


def clip_cov_loss(x: LossInputs) -> ModeResult:
    p = x.params
    pg_losses, clip_active, dual_active = ppo_clip(x, torch.exp(x.log_ratio))
    cov = _centered_cov(x)
    candidates = x.valid & ~clip_active & (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub)
    num_valid = int(x.valid.sum())
    selected = torch.zeros_like(x.valid)
    where = torch.nonzero(candidates)  # row-major, as verl's
    if len(where):
        gen = x.generator if x.generator is not None else torch.Generator().manual_seed(num_valid)
        keep = torch.randperm(len(where), generator=gen)[: max(int(p.clip_cov_ratio * num_valid), 1)]
        where = where[keep.to(where.device)]
        selected[where[:, 0], where[:, 1]] = True
    pg_losses = torch.where(selected, torch.zeros_like(pg_losses), pg_losses)
    return ModeResult(pg_losses=x.weigh(pg_losses),
                      token_metrics={"pg_clipfrac": clip_active, "pg_clipfrac_lower": dual_active,
                                     "cov_selected_frac": selected, "ppo_kl": -x.log_ratio})


def kl_cov_loss(x: LossInputs) -> ModeResult:
    p = x.params
    pg_losses = -x.advantages * torch.exp(x.log_ratio)
    selected = torch.zeros_like(x.valid)
    num_valid = int(x.valid.sum())
    if num_valid:
        cov = torch.where(x.valid, _centered_cov(x), torch.full_like(pg_losses, -torch.inf))
        top = torch.topk(cov.reshape(-1), max(1, int(num_valid * p.kl_cov_ratio))).indices
        selected.view(-1)[top] = True
    pg_losses = torch.where(selected, pg_losses + p.ppo_kl_coef * x.log_ratio.abs(), pg_losses)
    return ModeResult(pg_losses=x.weigh(pg_losses),
                      token_metrics={"cov_selected_frac": selected, "ppo_kl": -x.log_ratio})
