"""The continuous batch's KV cache in preallocated buffers: appends, joins and leaves without copying it.

transformers' DynamicLayer concatenates every decode step's keys and values onto the
cache (a copy of the whole cache per layer per step), and the continuous batch used to
copy it again whenever rows joined (left-pad and concatenate) or left (select the
remaining rows). On the tiny CPU run those copies were a quarter of the streaming
engine's time (py-spy: the per-step concatenation 13%, row selection 9%, joins 4%).

`RowBufferLayer` keeps each layer's keys and values in buffers of shape
[max_rows, kv_heads, columns, head_dim]. The running rows are buffer rows 0..rows-1 and
their live columns start..end-1, right-aligned as in the left-padded batch (the attention
mask of the batch hides each row's left padding). So:
- a decode step writes its one new column at `end` (the buffer grows, rarely, when full);
- joining rows writes only the newcomers' prefill cache, right-aligned to `end`, into the
  rows after the running ones (the live columns grow to the left when a newcomer is wider);
- leaving rows are replaced by the last running rows (only those rows are copied), and
  columns no row uses any more are dropped by moving `start`.
`keys`/`values` are views of the live block, which is what the attention reads.
Buffers start zeroed, so columns hidden by the mask always hold finite values (a masked
NaN would still poison the attention's weighted sum).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicLayer

__all__ = ["RowBufferLayer"]


class RowBufferLayer(DynamicLayer):
    """One attention layer's KV cache of the running batch (see the module docstring)."""

    def __init__(self, max_rows: int, spare_columns: int = 16) -> None:
        """Args:
            max_rows: the most rows the batch holds.
            spare_columns: the least room added on either side when the buffer grows; rows
                and columns grow by doubling, so the buffers stay within about twice what
                the running rows use.
        """
        super().__init__()
        self.max_rows = max_rows
        self.spare = max(1, spare_columns)
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.rows = 0
        self.start = 0
        self.end = 0

    # -------------------------------------------------------------- what the model calls

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the step's columns [rows, heads, n, dim] to every running row; return the live block."""
        del args, kwargs
        if self.kbuf is None or key_states.shape[0] != self.rows:
            raise RuntimeError(f"RowBufferLayer: {key_states.shape[0]} rows decoded, {self.rows} running")
        n = key_states.shape[-2]
        self._reserve(left=0, right=n)
        self.kbuf[: self.rows, :, self.end:self.end + n] = key_states
        self.vbuf[: self.rows, :, self.end:self.end + n] = value_states
        self.end += n
        self._views()
        return self.keys, self.values

    # -------------------------------------------------------------- what the decoder calls

    def join(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add rows whose (left-padded) cache is [k, heads, w, dim], right-aligned to the running rows'."""
        count, width = keys.shape[0], keys.shape[-2]
        if self.rows + count > self.max_rows:
            raise ValueError(f"{self.rows} + {count} rows exceed the batch's {self.max_rows}")
        if self.kbuf is None:
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
            shape = (count, keys.shape[1], width + 2 * self.spare, keys.shape[-1])
            self.kbuf = keys.new_zeros(shape)
            self.vbuf = values.new_zeros(shape)
            self.start = self.end = self.spare + width
        if self.rows == 0:  # nothing live: start the live block afresh
            self.start = self.end
        self._reserve(left=max(0, width - (self.end - self.start)), right=0, rows=self.rows + count)
        self.start = min(self.start, self.end - width)
        rows = slice(self.rows, self.rows + count)
        self.kbuf[rows, :, self.start:self.end - width] = 0  # the newcomers' left padding
        self.vbuf[rows, :, self.start:self.end - width] = 0
        self.kbuf[rows, :, self.end - width:self.end] = keys
        self.vbuf[rows, :, self.end - width:self.end] = values
        self.rows += count
        self._views()

    def move_rows(self, targets: Sequence[int], sources: Sequence[int], rows: int) -> None:
        """Copy rows `sources` into rows `targets` (live columns), then keep the first `rows`."""
        if targets:
            dst = torch.tensor(list(targets), device=self.kbuf.device)
            src = torch.tensor(list(sources), device=self.kbuf.device)
            live = slice(self.start, self.end)
            self.kbuf[dst, :, live] = self.kbuf[src, :, live]
            self.vbuf[dst, :, live] = self.vbuf[src, :, live]
        self.rows = rows
        self._views()

    def drop_left(self, columns: int) -> None:
        """Forget the first `columns` live columns (no running row uses them)."""
        self.start += columns
        self._views()

    # -------------------------------------------------------------- internals

    def _views(self) -> None:
        self.keys = self.kbuf[: self.rows, :, self.start:self.end]
        self.values = self.vbuf[: self.rows, :, self.start:self.end]

    def _reserve(self, *, left: int, right: int, rows: int = 0) -> None:
        """Make room for `left` more columns before start, `right` after end and `rows` rows.

        Reallocates (zeroed, the live block copied) only when the buffer lacks the room; it
        then grows by at least doubling, so appends cost amortised O(1) copies per column.
        """
        capacity, columns = self.kbuf.shape[0], self.kbuf.shape[2]
        if self.start >= left and self.end + right <= columns and rows <= capacity:
            return
        width = self.end - self.start
        if rows > capacity:
            capacity = min(self.max_rows, max(rows, 2 * capacity))
        new_start = left + self.spare
        room = max(self.spare, width + right)  # doubling to the right, where decoding appends
        shape = (capacity, self.kbuf.shape[1], new_start + width + right + room, self.kbuf.shape[-1])
        for name in ("kbuf", "vbuf"):
            old = getattr(self, name)
            new = old.new_zeros(shape)
            new[: self.rows, :, new_start:new_start + width] = old[: self.rows, :, self.start:self.end]
            setattr(self, name, new)
        self.start, self.end = new_start, new_start + width

    # -------------------------------------------------------------- DynamicLayer methods that
    # would reassign keys/values behind the buffers' bookkeeping: the decoder never calls them.

    def _unsupported(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("RowBufferLayer is the continuous batch's cache: rows join with join() and "
                                  "leave with move_rows(); generate()-style cache edits are not supported")

    batch_select_indices = reorder_cache = crop = batch_repeat_interleave = reset = _unsupported
