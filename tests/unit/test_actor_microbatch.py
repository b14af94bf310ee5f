"""Token-budget packing, DP balancing and micro-batch construction: exact outcomes."""

import pytest
import torch

from megatron_dapo.actor.microbatch import (
    RolloutBatch,
    balance_across_dp,
    build_microbatch,
    pack_microbatches,
)


def test_balance_lpt_is_deterministic_and_even() -> None:
    lengths = [10, 3, 7, 8, 2, 5]
    shards = balance_across_dp(lengths, 2)
    # 10 -> r0, 8 -> r1, 7 -> r1 (8 < 10), 5 -> r0 (10 < 15), 3 -> r0 (tie 15/15), 2 -> r1 (15 < 18)
    assert shards == [[0, 1, 5], [2, 3, 4]]
    assert [sum(lengths[i] for i in s) for s in shards] == [18, 17]


def test_balance_gives_every_rank_a_sequence_when_possible() -> None:
    shards = balance_across_dp([100, 1, 1, 1], 4)
    assert shards == [[0], [1], [2], [3]]
    assert balance_across_dp([5, 5], 3) == [[0], [1], []]


def test_pack_padded_budget_counts_padding() -> None:
    lengths = [6, 5, 4, 3, 2]
    bins = pack_microbatches(lengths, 12, padded=True)
    # decreasing: 6 | 5 -> 6*2=12 fits | 4 -> 6*3 no -> new [4]; 3 -> [4,3]=8; 2 -> [4,3,2]=12
    assert bins == [[0, 1], [2, 3, 4]]
    for b in bins:
        assert max(lengths[i] for i in b) * len(b) <= 12


def test_pack_packed_budget_counts_real_tokens() -> None:
    assert pack_microbatches([6, 5, 4, 3, 2], 11, padded=False) == [[0, 1], [2, 3, 4]]


def test_overlong_sequence_gets_its_own_microbatch() -> None:
    assert pack_microbatches([50, 3, 2], 10) == [[0], [1, 2]]


def test_equalize_splits_then_pads() -> None:
    lengths = [4, 4, 4, 4]
    assert pack_microbatches(lengths, 16) == [[0, 1, 2, 3]]
    assert pack_microbatches(lengths, 16, num_microbatches=2) == [[0, 2], [1, 3]]
    assert pack_microbatches(lengths, 16, num_microbatches=4) == [[0], [2], [1], [3]]
    assert pack_microbatches(lengths, 16, num_microbatches=6) == [[0], [2], [1], [3], [], []]
    with pytest.raises(ValueError, match="num_microbatches=1 is below the 2 micro-batches"):
        pack_microbatches([4, 4], 4, num_microbatches=1)


def test_bad_budget_names_the_setting() -> None:
    with pytest.raises(ValueError, match=r"max_tokens=0 must be >= 1 \(trainer.max_tokens_per_microbatch\)"):
        pack_microbatches([1], 0)


def _batch() -> RolloutBatch:
    ids = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([[0.0, 0, 2, 2, 2], [0, -1, -1, 0, 0]])
    return RolloutBatch(input_ids=ids, seq_lens=torch.tensor([5, 3]), response_mask=mask,
                        old_log_probs=-torch.arange(10.0).view(2, 5), advantages=adv)


def test_build_padded_shifts_loss_tensors_by_one() -> None:
    mb = build_microbatch(_batch(), [1, 0])
    assert mb.input_ids.tolist() == [[21, 22, 23, 0, 0], [11, 12, 13, 14, 15]]
    assert mb.targets.tolist() == [[22, 23, 0, 0, 0], [12, 13, 14, 15, 0]]
    assert mb.valid.tolist() == [[True, True, False, False, False], [True, True, True, True, False]]
    assert mb.loss_mask.tolist() == [[True, True, False, False, False], [False, True, True, True, False]]
    assert mb.advantages.tolist() == [[-1, -1, 0, 0, 0], [0, 2, 2, 2, 0]]
    assert mb.old_log_probs.tolist() == [[-6, -7, 0, 0, 0], [-1, -2, -3, -4, 0]]
    assert mb.packed_seq_params() is None
    assert mb.to_rows(torch.arange(10.0)).tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_build_packed_concatenates_and_maps_back() -> None:
    mb = build_microbatch(_batch(), [1, 0], packed=True)
    assert mb.input_ids.tolist() == [[21, 22, 23, 11, 12, 13, 14, 15]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert mb.cu_seqlens.tolist() == [0, 3, 8]
    rows = mb.to_rows(torch.arange(1.0, 9.0))
    assert rows.tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    params = mb.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 3, 8]
    assert params.max_seqlen_q == 5


def test_empty_microbatch_has_no_loss() -> None:
    mb = build_microbatch(_batch(), [])
    assert mb.input_ids.shape == (1, 1) and not mb.loss_mask.any() and not mb.valid.any()
    assert mb.advantages.tolist() == [[0.0]] and mb.ref_log_probs is None


def test_sequence_parallel_pads_padded_rows_to_a_multiple() -> None:
    # Width 5 -> 8 for TP 4: the extra columns are padding (no target, no loss), and the
    # rows map back to the same values as without the padding.
    plain = build_microbatch(_batch(), [1, 0])
    mb = build_microbatch(_batch(), [1, 0], pad_to_multiple=4)
    assert mb.input_ids.shape == (2, 8) and mb.position_ids.tolist()[0] == list(range(8))
    assert mb.input_ids[:, :5].tolist() == plain.input_ids.tolist() and not mb.input_ids[:, 5:].any()
    for name in ("targets", "valid", "loss_mask", "advantages", "old_log_probs"):
        assert getattr(mb, name)[:, :5].tolist() == getattr(plain, name).tolist(), name
        assert not getattr(mb, name)[:, 5:].any(), name
    assert build_microbatch(_batch(), [1, 0], pad_to_multiple=5).input_ids.shape == (2, 5)


def test_sequence_parallel_pads_packed_tokens_into_the_last_sequence() -> None:
    mb = build_microbatch(_batch(), [1, 0], packed=True, pad_to_multiple=3)
    assert mb.input_ids.tolist() == [[21, 22, 23, 11, 12, 13, 14, 15, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5]]
    # Causal attention keeps the padding out of the last sequence's real tokens.
    assert mb.cu_seqlens.tolist() == [0, 3, 9]
    assert mb.packed_seq_params().max_seqlen_q == 6
    assert mb.to_rows(torch.arange(1.0, 9.0)).tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]


def test_empty_microbatch_is_padded_to_the_multiple() -> None:
    mb = build_microbatch(_batch(), [], pad_to_multiple=2)
    assert mb.input_ids.shape == (1, 2) and not mb.loss_mask.any() and not mb.valid.any()
    with pytest.raises(ValueError, match="pad_to_multiple=0 must be >= 1"):
        build_microbatch(_batch(), [0], pad_to_multiple=0)


def test_rollout_batch_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 4\); every per-token tensor must match"):
        RolloutBatch(input_ids=torch.zeros(2, 5, dtype=torch.long), seq_lens=torch.tensor([5, 3]),
                     response_mask=torch.zeros(2, 5, dtype=torch.bool), advantages=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[1, 5\]"):
        RolloutBatch(input_ids=torch.zeros(2, 5, dtype=torch.long), seq_lens=torch.tensor([6, 3]),
                     response_mask=torch.zeros(2, 5, dtype=torch.bool))
