"""Host tensors carved from a few large blocks, each pinned at its exact size beside a GPU.

A colocated engine leader keeps the last sync's full weights on the host so a restarted server can
reload them (rollout/sglang/colocated.py): one copy of the model, N x 2 B, ~61 GiB at 32B. Pinned
one tensor at a time that is ~18k allocations through torch's caching host allocator, which rounds
each up to a power of two (c10's CachingHostAllocator, torch 2.4-2.13), so the copy could take up to
twice its size in page-locked memory the planner did not count. Here the tensors are views of
blocks (64 MiB growing to 1 GiB) allocated as ordinary host memory and page-locked with
``cudaHostRegister`` at exactly their size (as sglang 0.5.23 pins its host caches): the copy costs
its bytes plus at most one block's unused tail (under 1 GiB), and the planner counts that
(plan/host.restart_copy_bytes). Views are carved in first-use order and kept by name, so every
sync after the first reuses them (no allocation after the first sync).
"""

from __future__ import annotations

import logging

import torch

__all__ = ["ALIGN_BYTES", "BLOCK_BYTES", "MIN_BLOCK_BYTES", "HostArena"]

logger = logging.getLogger(__name__)

BLOCK_BYTES = 1 << 30
"""The largest block (a tensor larger than it gets a block of its own, exactly its size)."""
MIN_BLOCK_BYTES = 64 << 20
"""The first block; each next one is as large as all before it, up to BLOCK_BYTES, so a small model
pins little beyond its size and a large one ~N / 1 GiB blocks."""
ALIGN_BYTES = 512
"""Every view starts at a multiple of this (any dtype's alignment; a DMA-friendly boundary)."""


class HostArena:
    """Named host tensors in a few exactly-pinned blocks, reused while name, shape and dtype stay."""

    def __init__(self, *, pin: bool, block_bytes: int = BLOCK_BYTES) -> None:
        """Args:
            pin: page-lock the blocks (beside a GPU: device-to-host copies are then asynchronous).
            block_bytes: the largest block; the last block's unused tail (at most
                min(block_bytes, the bytes before it)) is the only waste.
        """
        self.pin = pin
        self.block_bytes = int(block_bytes)
        self._blocks: list[torch.Tensor] = []
        self._pinned: list[torch.Tensor] = []
        self._free = 0  # bytes left in the last block
        self._views: dict[str, torch.Tensor] = {}

    @property
    def reserved_bytes(self) -> int:
        """Host bytes the blocks hold (what the planner's restart copy counts)."""
        return sum(b.numel() for b in self._blocks)

    @property
    def used_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self._views.values())

    def items(self):
        """(name, host tensor) of every buffer carved."""
        return self._views.items()

    def buffer(self, name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The host tensor kept for `name` (carved on first use; a new shape or dtype carves a new one,
        the old bytes left unused until the arena is dropped)."""
        view = self._views.get(name)
        if view is not None and view.shape == torch.Size(shape) and view.dtype == dtype:
            return view
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        padded = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        if padded > self._free:
            grow = min(self.block_bytes, max(MIN_BLOCK_BYTES, self.reserved_bytes))
            self._new_block(max(grow, padded))
        block = self._blocks[-1]
        start = block.numel() - self._free
        self._free -= padded
        view = block[start:start + nbytes].view(dtype).view(shape)
        self._views[name] = view
        return view

    def _new_block(self, nbytes: int) -> None:
        block = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin and _register(block):
            self._pinned.append(block)
        self._blocks.append(block)
        self._free = nbytes

    def close(self) -> None:
        """Unpin and drop every block (the views must no longer be used)."""
        for block in self._pinned:
            _unregister(block)
        self._blocks, self._pinned, self._views, self._free = [], [], {}, 0


def _register(block: torch.Tensor) -> bool:
    """cudaHostRegister the block at its exact size; False (left pageable, copies then synchronous) on failure."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), block.numel(), 0)
    except Exception as e:  # no CUDA runtime: nothing to pin for
        logger.warning("could not pin a %d-byte host block: %s", block.numel(), e)
        return False
    ok = int(getattr(err, "value", err)) == 0
    if not ok:
        logger.warning("cudaHostRegister of a %d-byte host block failed (%s): it stays pageable", block.numel(), err)
    return ok


def _unregister(block: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(block.data_ptr())
    except Exception as e:  # the process is ending, or the runtime is gone
        logger.debug("cudaHostUnregister: %s", e)
