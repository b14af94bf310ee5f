"""Tool tokens never reach the loss (issue 40): the batch's response_mask is the episode's policy mask."""

from __future__ import annotations

import torch

from megatron_dapo.collect.shards import to_shard


def test_an_episodes_tool_tokens_are_out_of_the_response_mask_and_plain_rows_keep_theirs():
    prompt, response = [5, 6, 7], [10, 11, 12, 13, 14, 15]
    policy = [1, 1, 0, 0, 0, 1]  # call, answer (tool), continuation
    rows = [(prompt, response, 0.5, [-0.1] * 6, True, None, policy),
            (prompt, response, -0.5, [-0.2] * 6, True, None, None),
            (prompt, response, 1.0, [-0.3] * 6, False, None, policy)]  # overlong-filtered: nothing
    batch = to_shard(rows).batch
    assert batch.response_mask[0].tolist() == [False] * 3 + [True, True, False, False, False, True]
    assert batch.response_mask[1].tolist() == [False] * 3 + [True] * 6
    assert not batch.response_mask[2].any()
    # The loss, entropy and clip fraction all read this mask; token-mean counts its tokens.
    assert int(batch.response_mask.sum()) == 3 + 6 == int(torch.tensor(policy).sum()) + 6
