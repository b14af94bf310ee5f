"""rollout/local/kv_rows.py: the batch's KV buffers hold exactly each running row's own keys, right-aligned."""

import random

import torch

from megatron_dapo.rollout.local.kv_rows import RowBufferLayer

HEADS, DIM = 2, 3


def _live_rows(layer: RowBufferLayer) -> list[torch.Tensor]:
    return [layer.keys[b] for b in range(layer.rows)]


def test_random_joins_appends_and_leaves_match_per_row_references():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    layer = RowBufferLayer(max_rows=12, spare_columns=2)  # small spare: the buffer must grow both ways
    reference: list[torch.Tensor] = []  # per running row: its keys [heads, length, dim]
    next_value = 1.0
    for step in range(200):
        op = rng.choice(["join", "append", "append", "leave"]) if reference else "join"
        if op == "join" and len(reference) < 12:
            count = rng.randint(1, min(3, 12 - len(reference)))
            lens = [rng.randint(1, 9) for _ in range(count)]
            width = max(lens)
            keys = torch.zeros(count, HEADS, width, DIM)
            for i, n in enumerate(lens):
                row = torch.randn(HEADS, n, DIM, generator=gen)
                keys[i, :, width - n:] = row
                reference.append(row)
            layer.join(keys, keys.clone())
        elif op == "append" and reference:
            new = torch.full((len(reference), HEADS, 1, DIM), next_value)
            next_value += 1
            keys, values = layer.update(new, new.clone())
            assert keys.shape == values.shape and keys.shape[0] == len(reference)
            reference = [torch.cat([r, new[b]], dim=1) for b, r in enumerate(reference)]
        elif op == "leave" and reference:
            keep = torch.tensor([rng.random() < 0.7 for _ in reference])
            remaining = int(keep.sum())
            holes = [b for b in range(remaining) if not keep[b]]
            movers = [b for b in range(remaining, len(reference)) if keep[b]]
            order = list(range(remaining))
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
            layer.move_rows(holes, movers, remaining)
            reference = [reference[b] for b in order]
            if reference:  # drop columns before the longest row, as the decoder does
                unused = layer.end - layer.start - max(r.shape[1] for r in reference)
                if unused > 0:
                    layer.drop_left(unused)
            else:
                layer = RowBufferLayer(max_rows=12, spare_columns=2)
        if reference:
            assert layer.keys.shape[2] == layer.end - layer.start
            assert layer.keys.shape[2] >= max(r.shape[1] for r in reference)
            for b, r in enumerate(reference):  # right-aligned, values and keys alike
                assert torch.equal(layer.keys[b, :, -r.shape[1]:], r), (step, b)
                assert torch.equal(layer.values[b, :, -r.shape[1]:], r), (step, b)
            assert bool(torch.isfinite(layer.keys).all())


def test_buffers_grow_with_what_runs_not_with_the_batch_limit():
    layer = RowBufferLayer(max_rows=256)
    keys = torch.zeros(2, HEADS, 5, DIM)
    layer.join(keys, keys)
    assert layer.kbuf.shape[0] == 2 and layer.kbuf.shape[2] <= 5 + 2 * 16
    for _ in range(100):  # appends: amortised doubling, never more than twice the live width (+ spare)
        layer.update(torch.ones(2, HEADS, 1, DIM), torch.ones(2, HEADS, 1, DIM))
        assert layer.kbuf.shape[2] <= 2 * (layer.end - layer.start) + 2 * 16 + 1
    layer.join(torch.zeros(3, HEADS, 4, DIM), torch.zeros(3, HEADS, 4, DIM))
    assert layer.kbuf.shape[0] == 5
    try:
        layer.batch_select_indices(torch.tensor([0]))
    except NotImplementedError as err:
        assert "join()" in str(err)
    else:
        raise AssertionError("batch_select_indices must not silently bypass the buffers")
