"""The restart copy's host arena (rollout/host_arena.py): exact blocks, views that keep their bytes, reuse.

The pinning itself (cudaHostRegister at the block's exact size) needs a GPU; here the carving: a
leader's copy of the model costs its bytes plus at most one block's tail, each name keeps its
buffer across syncs, and no view overlaps another.
"""

from __future__ import annotations

import torch

from megatron_dapo.rollout.host_arena import ALIGN_BYTES, MIN_BLOCK_BYTES, HostArena


def test_views_are_disjoint_reused_by_name_and_cost_their_bytes_plus_one_tail() -> None:
    arena = HostArena(pin=False, block_bytes=4 * MIN_BLOCK_BYTES)
    gen = torch.Generator().manual_seed(0)
    shapes = [((1000, 700), torch.bfloat16), ((3,), torch.float32), ((7, 5, 3), torch.int64),
              ((1024, 1024), torch.bfloat16), ((MIN_BLOCK_BYTES // 8 + 1,), torch.uint8)] * 30
    tensors = {f"t{i}": torch.randint(0, 100, shape, generator=gen, dtype=torch.int16).to(dtype)
               for i, (shape, dtype) in enumerate(shapes)}
    for name, t in tensors.items():
        arena.buffer(name, t.shape, t.dtype).copy_(t)
    for name, t in tensors.items():  # nothing written later overwrote an earlier view
        assert torch.equal(arena.buffer(name, t.shape, t.dtype), t)
    ptrs = {name: arena.buffer(name, t.shape, t.dtype).data_ptr() for name, t in tensors.items()}
    for name, t in tensors.items():  # a second sync: the same views
        assert arena.buffer(name, t.shape, t.dtype).data_ptr() == ptrs[name]
    used = sum(t.numel() * t.element_size() for t in tensors.values())
    assert arena.used_bytes == used
    padding = len(tensors) * ALIGN_BYTES
    assert used <= arena.reserved_bytes <= used + padding + 4 * MIN_BLOCK_BYTES
    assert all((p - arena._blocks[0].data_ptr()) % ALIGN_BYTES == 0 for p in list(ptrs.values())[:5])
    # Blocks: a few, not one per tensor (torch's pinned allocator rounds each allocation up).
    assert len(arena._blocks) < len(tensors) // 10


def test_a_new_shape_gets_a_new_view_and_a_tensor_larger_than_a_block_its_own() -> None:
    arena = HostArena(pin=False, block_bytes=MIN_BLOCK_BYTES)
    a = arena.buffer("w", (4, 4), torch.float32)
    b = arena.buffer("w", (8, 4), torch.float32)
    assert b.shape == (8, 4) and b.data_ptr() != a.data_ptr()
    big = arena.buffer("big", (MIN_BLOCK_BYTES + 3,), torch.uint8)
    assert big.numel() == MIN_BLOCK_BYTES + 3
    assert arena._blocks[-1].numel() >= MIN_BLOCK_BYTES + 3
    arena.close()
    assert arena.reserved_bytes == 0
