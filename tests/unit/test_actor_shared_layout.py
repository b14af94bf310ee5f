"""The shared-prompt micro-batch layout: what goes into the model and where each row reads from.

The model-level check (the same log-probs and gradient as float64 transformers in every
TP/PP/DP layout) is tests/multirank/test_actor_train_step.py; here, without a model, the
packed tokens, positions, segment indices and masks of actor/shared_layout.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.microbatch import RolloutBatch, build_microbatch, pack_microbatches
from megatron_dapo.actor.shared_layout import build_shared_microbatch, prompt_groups

# Rows 0, 1, 3 share prompt A (4 tokens), row 2 has prompt B (3 tokens) alone, row 4 shares
# B's tokens but its response starts later (a different prompt), row 5 is A with an empty response.
PROMPT_A = [11, 12, 13, 14]
PROMPT_B = [21, 22, 23]
ROWS = [
    (PROMPT_A, [31, 32, 33]),
    (PROMPT_A, [41, 42]),
    (PROMPT_B, [51, 52, 53, 54]),
    (PROMPT_A, [61]),
    ([*PROMPT_B, 24], [71, 72]),
    (PROMPT_A, []),
]


def _batch() -> RolloutBatch:
    width = max(len(p) + len(r) for p, r in ROWS) + 2  # extra padding columns on every row
    ids = torch.zeros(len(ROWS), width, dtype=torch.long)
    response = torch.zeros(len(ROWS), width, dtype=torch.bool)
    for i, (prompt, resp) in enumerate(ROWS):
        ids[i, : len(prompt) + len(resp)] = torch.tensor(prompt + resp)
        response[i, len(prompt): len(prompt) + len(resp)] = True
    lens = torch.tensor([len(p) + len(r) for p, r in ROWS])
    adv = torch.arange(len(ROWS), dtype=torch.float32).unsqueeze(1).expand(-1, width).contiguous()
    return RolloutBatch(input_ids=ids, seq_lens=lens, response_mask=response, advantages=adv)


def test_prompt_groups_key_on_the_tokens_before_the_response():
    assert prompt_groups(_batch()) == [(0, 4), (0, 4), (2, 3), (0, 4), (4, 4), (0, 4)]


def test_each_prompt_enters_the_model_once_and_every_row_reads_its_own_tokens():
    batch = _batch()
    mb = build_shared_microbatch(batch, list(range(len(ROWS))))
    # A once (4) + responses 3 + 2 + 1; B alone (7 tokens, a row of its own); row 4 (6).
    assert mb.input_ids.shape == (1, 4 + 3 + 2 + 1 + 7 + 6)
    assert mb.position_ids.shape == mb.input_ids.shape
    ids, positions = mb.input_ids[0], mb.position_ids[0]
    for r, (prompt, resp) in enumerate(ROWS):
        tokens = prompt + resp
        for t in range(len(tokens)):  # the model position row r's token t sits at
            src = int(mb.source_index[r, t])
            assert int(ids[src]) == tokens[t], (r, t)
            assert int(positions[src]) == t, (r, t)
    # The last prompt position of A is one model position serving every row of A.
    assert len({int(mb.source_index[r, 3]) for r in (0, 1, 3, 5)}) == 1
    # Loss-side tensors are the padded layout's [n, S] rows.
    padded = build_microbatch(batch, list(range(len(ROWS))))
    for name in ("targets", "valid", "loss_mask", "advantages"):
        assert torch.equal(getattr(mb, name), getattr(padded, name)), name


def test_segment_indices_and_masks_give_each_token_its_padded_row_attention():
    mb = build_shared_microbatch(_batch(), list(range(len(ROWS))))
    p = mb.shared
    total = mb.input_ids.shape[1]
    assert p.qkv_format == "thd" and p.cu_seqlens_q.tolist() == [0, total]
    assert p.max_seqlen_q == int(mb.position_ids.max()) + 1
    # Reconstruct, for every packed token, the set of packed tokens it attends to: the
    # attention's output rows are every prefix group's [P, Lp], then every suffix group's [Q, Ls].
    readers: list[tuple[int, set[int]]] = []  # per output row: (the packed token it holds, what it sees)
    for index in p.prefix_index:  # causal within the segment
        for seg in range(index.shape[0]):
            readers += [(int(index[seg, i]), set(index[seg, : i + 1].tolist())) for i in range(index.shape[1])]
    for index, kv, mask in zip(p.suffix_index, p.suffix_kv_index, p.suffix_mask, strict=True):
        for seg in range(index.shape[0]):
            readers += [(int(index[seg, i]), set(kv[seg][mask[seg, 0, i]].tolist())) for i in range(index.shape[1])]
    assert len(set(p.out_index.tolist())) == total  # every packed token reads its own output row
    seen: dict[int, set[int]] = {}
    for token, out_row in enumerate(p.out_index.tolist()):
        held, visible = readers[out_row]
        assert held == token
        seen[token] = visible
    # Expected: a token at row position t attends to the row's positions 0..t.
    for r, (prompt, resp) in enumerate(ROWS):
        for t in range(len(prompt) + len(resp)):
            src = int(mb.source_index[r, t])
            assert seen[src] == {int(mb.source_index[r, u]) for u in range(t + 1)}, (r, t)


def test_sequence_parallel_padding_is_a_segment_of_its_own():
    mb = build_shared_microbatch(_batch(), [0, 1, 2], pad_to_multiple=6)
    real = 4 + 3 + 2 + 7
    assert mb.input_ids.shape[1] == 18
    p = mb.shared
    padding = [index[seg].tolist() for index in p.prefix_index for seg in range(index.shape[0])
               if int(index[seg, 0]) == real]
    assert padding and set(padding[0]) == {16, 17}  # the padding attends only to itself
    assert mb.position_ids[0, real:].tolist() == [0, 1]
    assert int(mb.source_index.max()) < real  # no row reads the padding


def test_an_empty_micro_batch_keeps_ranks_in_lockstep():
    mb = build_shared_microbatch(_batch(), [], pad_to_multiple=2)
    assert mb.indices == [] and mb.shared is None and mb.input_ids.shape == (1, 2)
    assert not bool(mb.loss_mask.any())


def test_the_budget_counts_a_shared_prompt_once_and_keeps_its_rows_together():
    batch = _batch()
    lengths = batch.seq_lens.tolist()
    prompts = prompt_groups(batch)
    assert sum(lengths) == 7 + 6 + 7 + 5 + 6 + 4
    # Prompt A's four rows cost 4 + 3 + 2 + 1 + 0 = 10 together, B 7, row 4 6: 23.
    assert pack_microbatches(lengths, 23, padded=False, prompts=prompts) == [[0, 1, 3, 5, 2, 4]]
    bins = pack_microbatches(lengths, 13, padded=False, prompts=prompts)
    assert bins[0] == [0, 1, 3, 5]  # the group first and whole (cost 10)
    assert sorted(i for b in bins for i in b) == list(range(len(ROWS)))
    split = pack_microbatches(lengths, 23, padded=False, prompts=prompts, num_microbatches=2)
    assert split == [[0, 1, 3], [5, 2, 4]]  # cut in the middle, not every other row
    with pytest.raises(ValueError, match="padded=False"):
        pack_microbatches(lengths, 23, prompts=prompts)


def test_one_long_response_does_not_pad_the_short_ones():
    long_row = (PROMPT_A, list(range(100, 160)))
    rows = [long_row] + [(PROMPT_A, [7, 8])] * 7
    width = 4 + 60
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    response = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (prompt, resp) in enumerate(rows):
        ids[i, : len(prompt) + len(resp)] = torch.tensor(prompt + resp)
        response[i, len(prompt): len(prompt) + len(resp)] = True
    batch = RolloutBatch(input_ids=ids, seq_lens=torch.tensor([len(p) + len(r) for p, r in rows]),
                         response_mask=response)
    mb = build_shared_microbatch(batch, list(range(len(rows))))
    real = sum(len(r) for _, r in rows)
    padded = sum(index.numel() for index in mb.shared.suffix_index)
    assert padded <= 2 * real < len(rows) * 60  # one group of 8 would have padded 480 query rows
    assert [index.shape[1] for index in mb.shared.suffix_index] == [60, 2]  # two groups of lengths


def test_the_callers_prompt_groups_give_the_same_micro_batch():
    batch = _batch()
    for indices in ([1, 2, 3, 4], [5, 0, 3]):
        own = build_shared_microbatch(batch, indices)
        given = build_shared_microbatch(batch, indices, prompts=prompt_groups(batch))
        for name in ("input_ids", "position_ids", "source_index"):
            assert torch.equal(getattr(own, name), getattr(given, name)), (indices, name)
        assert torch.equal(own.shared.out_index, given.shared.out_index)
