"""Context-parallel split / gather / loss-scale math: exact outcomes on CPU."""

import itertools

import pytest
import torch

from megatron_dapo.actor.context_parallel import (
    cp_pad_multiple,
    cp_positions,
    gather_sequence,
    microbatch_loss_scale,
    split_sequence,
    thd_cp_positions,
)
from megatron_dapo.actor.microbatch import RolloutBatch, build_microbatch
from megatron_dapo.algo import agg_loss


def test_load_balanced_chunks_exactly() -> None:
    # 2cp = 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert cp_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="sequence length 6 is not a multiple of 2 x cp = 4"):
        cp_positions(6, 2, 0)


def test_pad_multiple() -> None:
    assert [cp_pad_multiple(1), cp_pad_multiple(2), cp_pad_multiple(4)] == [1, 4, 8]
    assert cp_pad_multiple(2, tp=8, sequence_parallel=True) == 32
    assert cp_pad_multiple(2, tp=8, sequence_parallel=False) == 4
    assert cp_pad_multiple(1, tp=4, sequence_parallel=True) == 4


@pytest.mark.parametrize(("cp", "seq_len"), [(1, 7), (2, 8), (2, 24), (3, 18), (4, 64)])
def test_round_trip_token_counts_and_causal_balance(cp: int, seq_len: int) -> None:
    t = torch.randn(3, seq_len, 5)
    positions = [cp_positions(seq_len, cp, r) for r in range(cp)]
    parts = [split_sequence(t, p, dim=1) for p in positions]
    assert all(p.shape == (3, seq_len // cp, 5) for p in parts)
    assert torch.equal(gather_sequence(parts, positions, dim=1), t)
    assert sorted(torch.cat(positions).tolist()) == list(range(seq_len))
    # Causal attention work of a token grows with its position: every rank gets the same total.
    work = {int((p + 1).sum()) for p in positions}
    assert len(work) == 1


def test_thd_partitions_every_sequence_on_its_own() -> None:
    cu = [0, 4, 12]  # lengths 4 and 8, multiples of 2cp = 4
    assert thd_cp_positions(cu, 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert thd_cp_positions(cu, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    values = torch.arange(12.0).unsqueeze(0)
    positions = [thd_cp_positions(cu, 2, r) for r in range(2)]
    parts = [split_sequence(values, p) for p in positions]
    assert torch.equal(gather_sequence(parts, positions), values)


def _batch() -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([8, 6, 3])
    ids = torch.randint(1, 50, (3, 8), generator=gen)
    pos = torch.arange(8)
    ids = torch.where(pos < lens.unsqueeze(1), ids, 0)
    mask = (pos >= torch.tensor([2, 1, 1]).unsqueeze(1)) & (pos < lens.unsqueeze(1))
    return RolloutBatch(input_ids=ids, seq_lens=lens, response_mask=mask,
                        advantages=torch.randn(3, 8, generator=gen), old_log_probs=torch.randn(3, 8, generator=gen))


def test_targets_are_shifted_before_the_split() -> None:
    # Position t predicts token t + 1 even when t + 1 lives on the other CP rank.
    mb = build_microbatch(_batch(), [0, 1, 2], pad_to_multiple=4)
    assert mb.input_ids.shape[1] % 4 == 0
    width = mb.input_ids.shape[1]
    for rank in range(2):
        held = cp_positions(width, 2, rank)
        tokens, targets = split_sequence(mb.input_ids, held), split_sequence(mb.targets, held)
        valid = split_sequence(mb.valid, held)
        nxt = mb.input_ids[:, torch.clamp(held + 1, max=width - 1)]
        assert torch.equal(torch.where(valid, targets, 0), torch.where(valid, nxt, 0))
        assert tokens.shape == targets.shape == (3, width // 2)
    # The chunk boundary case: rank 0's last position of its first chunk predicts rank 1's first token.
    assert int(mb.targets[0, 1]) == int(mb.input_ids[0, 2])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("cp", [2, 3])
def test_per_rank_losses_sum_to_the_unsplit_loss(mode: str, cp: int) -> None:
    # Loss kept local: token counts summed over the CP ranks, the sequence count taken on
    # the whole batch (a sequence spans every CP rank).
    gen = torch.Generator().manual_seed(cp)
    seq_len = 4 * cp
    loss_mat = torch.randn(5, seq_len, generator=gen, dtype=torch.float64)
    mask = torch.rand(5, seq_len, generator=gen) < 0.6
    whole = agg_loss(loss_mat, mask, mode, loss_scale_factor=16)
    positions = [cp_positions(seq_len, cp, r) for r in range(cp)]
    local_masks = [split_sequence(mask, p) for p in positions]
    num_tokens = sum(int(m.sum()) for m in local_masks)
    assert num_tokens == int(mask.sum())
    num_seqs = int(mask.any(dim=-1).sum())
    total = sum(agg_loss(split_sequence(loss_mat, p), m, mode, num_tokens, num_seqs, 16)
                for p, m in zip(positions, local_masks, strict=True))
    assert float(total) == pytest.approx(float(whole), rel=1e-12)


def test_gathered_log_probs_give_the_unsplit_loss_in_every_mode() -> None:
    loss_mat = torch.randn(4, 8, dtype=torch.float64)
    mask = torch.rand(4, 8) < 0.7
    positions = [cp_positions(8, 2, r) for r in range(2)]
    gathered = gather_sequence([split_sequence(loss_mat, p) for p in positions], positions)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert float(agg_loss(gathered, mask, mode)) == float(agg_loss(loss_mat, mask, mode))


def _megatron_gradient_weight(scale: int, num_mb: int, dp: int, cp: int, shares: torch.Tensor) -> float:
    """What megatron-core 0.16.1 back-propagates in total for per-rank, per-micro-batch losses.

    forward_step_calc_loss: loss x cp / num_mb; DDP: gradient x 1 / (dp x cp), summed over dp x cp.
    """
    per_rank = shares * scale * cp / num_mb / (dp * cp)
    return float(per_rank.sum())


@pytest.mark.parametrize(("num_mb", "dp", "cp"), list(itertools.product([1, 3], [1, 2, 4], [1, 2, 4])))
def test_loss_scale_gives_the_global_objective_for_any_layout(num_mb: int, dp: int, cp: int) -> None:
    # Shares of the global objective (every rank's own tokens over the global count) sum to it.
    shares = torch.rand(dp, cp, num_mb, dtype=torch.float64)
    objective = float(shares.sum())
    scale = microbatch_loss_scale(num_mb, dp)
    assert _megatron_gradient_weight(scale, num_mb, dp, cp, shares) == pytest.approx(objective, rel=1e-12)
    # The bug the issue describes: every CP rank returning the whole objective is cp x too large.
    replicated = shares.sum(dim=1, keepdim=True).expand(dp, cp, num_mb)
    assert _megatron_gradient_weight(scale, num_mb, dp, cp, replicated) == pytest.approx(cp * objective, rel=1e-12)

