"""A step's kept groups as the actor's inputs: rows per DP rank and mini-batch, then padded tensors.

`split_batch` cuts the batch into mini-batches of whole groups (the token-mean is over a
mini-batch, DESIGN.md) and balances each mini-batch's samples over the DP ranks by length;
`to_shard` pads one rank's share of a mini-batch into the tensors the actor runs on, with a
response mask that leaves out overlong-filtered responses and a tool's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dapo.actor.microbatch import RolloutBatch, balance_across_dp
from megatron_dapo.actor.route_layout import pad_routes
from megatron_dapo.collect.types import Group

__all__ = ["Shard", "split_batch", "to_shard"]


@dataclass(kw_only=True)
class Shard:
    """One mini-batch's share of this rank: model inputs plus the engine's log-probs."""

    batch: RolloutBatch
    """Inputs, masks, advantages (old log-probs are filled in step 5)."""
    rollout_log_probs: torch.Tensor
    """[B, S] engine log-probs aligned like input_ids (0 outside responses)."""


def split_batch(groups: list[Group], mini_batch_groups: int, dp: int, overlong_filtering: bool) -> list[list[list[tuple]]]:
    """[dp_rank][mini_batch] -> rows (prompt_ids, response_ids, advantage, rollout_lps, keep, routes, loss mask)."""
    per_dp: list[list[list[tuple]]] = [[] for _ in range(dp)]
    for start in range(0, len(groups), mini_batch_groups):
        samples = [s for g in groups[start:start + mini_batch_groups] for s in g.samples]
        shards = balance_across_dp([len(s.prompt_ids) + len(s.response_ids) for s in samples], dp)
        for rank, indices in enumerate(shards):
            per_dp[rank].append([
                (samples[i].prompt_ids, samples[i].response_ids, samples[i].advantage,
                 samples[i].rollout_log_probs, not (overlong_filtering and samples[i].truncated),
                 samples[i].routed_experts, samples[i].loss_mask)
                for i in indices])
    return per_dp


def to_shard(rows: list[tuple]) -> Shard:
    """Right-padded tensors of one mini-batch share, aligned like input_ids.

    The pad value never matters: padding is causal-masked and outside response_mask.
    """
    lengths = [len(p) + len(r) for p, r, *_ in rows] or [1]
    width = max(lengths)
    num = len(rows)
    input_ids = torch.zeros((num, width), dtype=torch.long)
    mask = torch.zeros((num, width), dtype=torch.bool)
    advantages = torch.zeros((num, width), dtype=torch.float32)
    rollout_lp = torch.zeros((num, width), dtype=torch.float32)
    for i, (prompt, response, adv, lps, keep, _, loss_mask) in enumerate(rows):
        lp, lr = len(prompt), len(response)
        input_ids[i, :lp] = torch.tensor(prompt)
        input_ids[i, lp:lp + lr] = torch.tensor(response)
        mask[i, lp:lp + lr] = keep
        if loss_mask is not None:  # an episode: a tool's tokens never carry loss
            mask[i, lp:lp + lr] &= torch.tensor(loss_mask, dtype=torch.bool)
        advantages[i, lp:lp + lr] = adv
        rollout_lp[i, lp:lp + lr] = torch.tensor(lps)
    batch = RolloutBatch(input_ids=input_ids, seq_lens=torch.tensor(lengths[:num], dtype=torch.long),
                         response_mask=mask, advantages=advantages, routes=pad_routes([row[5] for row in rows], width))
    return Shard(batch=batch, rollout_log_probs=rollout_lp)
