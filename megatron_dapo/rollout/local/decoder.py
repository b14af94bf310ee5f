"""Continuous batching for the local engine: rows join the running batch as others leave.

One `ContinuousDecoder.step` is one decode step of every running row plus, when rows are
admitted, the prefill of the newcomers. The newcomers' prefill cache is written,
right-aligned, into the running batch's preallocated KV buffers (rollout/local/kv_rows.py); the
attention mask hides each row's left padding and position ids count only a row's real
tokens, so a row computes what it would compute alone, whoever its batch mates are. The n
rows of a prompt are prefilled once and share that prefill's cache and logits (copied per
row, as each row then decodes on its own). Finished rows leave the batch (and the cache)
at once, the last running rows taking their places, and cache columns that no row uses any
more (the left padding of rows that left) are dropped, so the live cache never grows past
the longest running row.

Each row samples from its own counter-based stream (sampling.counter_uniforms with the
row's seed and token count), so its tokens do not depend on when it joined either. The
schedule itself (which rows are admitted at which step) is decided by the caller from
token counts only, never from wall time, so a seeded run is reproducible run to run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from megatron_dapo.rollout.engine import FinishReason, SamplingParams
from megatron_dapo.rollout.local.kv_rows import RowBufferLayer
from megatron_dapo.rollout.local.sampling import counter_uniforms, sample_next_tokens
from megatron_dapo.rollout.routes import HFRouteRecorder

__all__ = ["ContinuousDecoder", "DecodeRow", "FinishedRow"]


@dataclass(kw_only=True, slots=True, frozen=True)
class DecodeRow:
    """One response to generate."""

    prompt_index: int
    """Global prompt index."""
    sample_index: int
    """Which of the prompt's n responses."""
    prompt: Sequence[int]
    """Prompt token ids."""
    seed: int
    """The response's stream seed (engine.response_seed)."""
    limit: int
    """Most tokens in the response (max_new_tokens, or less where the context ends), prefix included."""
    prefix: tuple[int, ...] = ()
    """Tokens already generated (a partial rollout continued): the row resumes after them."""
    prefix_logprobs: tuple[float, ...] = ()
    """The engine log-probs the prefix was sampled with (under older weights)."""
    prefix_routes: np.ndarray | None = None
    """The routes the carried response was reported with (kept if it never joins again)."""


@dataclass(kw_only=True, slots=True)
class FinishedRow:
    """A row that left the batch, with what it generated."""

    row: DecodeRow
    """The row."""
    output_ids: list[int]
    """Generated token ids."""
    logprobs: list[float]
    """Temperature-scaled log-probs of the generated tokens."""
    finish_reason: FinishReason
    """stop, length or abort."""
    routed_experts: np.ndarray | None = None
    """[P + len(output_ids) - 1, L, k] expert ids of every token forwarded (rollout/routes.py);
    None without a route recorder."""


class ContinuousDecoder:
    """The running batch of the local engine: KV cache, masks, per-row counters and outputs."""

    def __init__(
        self, model: PreTrainedModel, *, params: SamplingParams, stop_ids: Sequence[int], max_rows: int,
        device: torch.device, routes: HFRouteRecorder | None = None,
    ) -> None:
        """An empty batch.

        Args:
            model: the HF causal LM (eval mode).
            params: sampling settings shared by every row.
            stop_ids: token ids that end a response (eos and the request's stop ids).
            max_rows: the most rows decoded together (bounds the KV cache).
            device: where the model runs; sampling and bookkeeping stay on CPU.
            routes: records every forward's expert ids (an MoE model); each finished row then
                carries the routes of its prompt and response tokens.
        """
        self._model = model
        self._params = params
        self._stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        self._device = device
        self.max_rows = max_rows
        width = params.max_new_tokens
        self._out_ids = torch.zeros(max_rows, width, dtype=torch.long)  # one slot per running row
        self._out_lps = torch.zeros(max_rows, width, dtype=torch.float64)
        self._free_slots = list(range(max_rows - 1, -1, -1))
        self._rows: list[DecodeRow] = []
        self._slots = torch.zeros(0, dtype=torch.long)  # [b] slot of each batch row
        self._seeds = torch.zeros(0, dtype=torch.long)
        self._counts = torch.zeros(0, dtype=torch.long)
        self._limits = torch.zeros(0, dtype=torch.long)
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)  # [b, C]: which cache columns are real tokens
        self._next_ids = torch.zeros(0, dtype=torch.long)  # [b] the token each row feeds next
        self._routes = routes if routes is not None and routes.num_layers else None
        if self._routes is not None:  # response token j's routes, recorded when it is fed
            self._out_routes = torch.zeros(max_rows, width, routes.num_layers, routes.top_k,
                                           dtype=routes._torch_dtype)
            self._ctx_routes: dict[int, torch.Tensor] = {}  # slot -> routes of its prefilled context

    @property
    def num_running(self) -> int:
        """Rows in the batch."""
        return len(self._rows)

    @property
    def num_free(self) -> int:
        """Rows that can still join."""
        return self.max_rows - len(self._rows)

    def step(self, new_rows: Sequence[DecodeRow] = ()) -> list[FinishedRow]:
        """Admit `new_rows` (prefill), decode one token for every row, drop the finished ones.

        Args:
            new_rows: rows joining now; at most `num_free`, each with limit >= 1.

        Returns:
            The rows that finished at this step (stop token or limit), in batch order.
        """
        if len(new_rows) > self.num_free:
            raise ValueError(f"{len(new_rows)} rows cannot join a batch with {self.num_free} free rows")
        logits: list[torch.Tensor] = []
        if self._rows:
            mask = torch.cat([self._mask, self._mask.new_ones(len(self._rows), 1)], dim=-1)
            positions = self._mask.sum(-1, keepdim=True)  # real tokens before the one fed now
            step_logits, routes = self._forward(self._next_ids.unsqueeze(-1), mask, positions, self._cache)
            logits.append(step_logits)
            if routes is not None:  # the fed token is each row's last generated one
                self._out_routes[self._slots, self._counts - 1] = routes[:, 0]
            self._mask = mask
        if new_rows:
            # A prompt's n rows share one context: prefill each distinct context once, then
            # give every row its context's cache and logits.
            contexts: dict[tuple[int, ...], int] = {}
            inverse = torch.tensor([contexts.setdefault((*r.prompt, *r.prefix), len(contexts)) for r in new_rows],
                                   dtype=torch.long)
            new_cache = DynamicCache(config=self._model.config)
            lens = torch.tensor([len(c) for c in contexts], dtype=torch.long)
            width = int(lens.max())
            new_mask = (torch.arange(width).unsqueeze(0) >= (width - lens).unsqueeze(1)).long()  # left-padded
            input_ids = torch.zeros(len(contexts), width, dtype=torch.long)
            input_ids[new_mask.bool()] = torch.tensor([t for c in contexts for t in c], dtype=torch.long)
            positions = (new_mask.cumsum(-1) - 1).clamp(min=0)
            prefill, routes = self._forward(input_ids, new_mask, positions, new_cache)
            context_routes = None
            if routes is not None:  # each row's context without its left padding
                context_routes = [routes[inverse[r], width - int(lens[inverse[r]]):] for r in range(len(new_rows))]
            if len(contexts) < len(new_rows):
                prefill, new_mask = prefill[inverse], new_mask[inverse]
                new_cache.batch_select_indices(inverse.to(self._device))
            logits.append(prefill)
            self._join(new_rows, new_cache, new_mask, context_routes)
        if not self._rows:
            return []
        return self._sample_and_retire(torch.cat(logits) if len(logits) > 1 else logits[0])

    def abort(self) -> list[FinishedRow]:
        """End every running row with reason "abort", keeping what it generated."""
        finished = [self._finished(b, "abort") for b in range(len(self._rows))]
        self._keep(torch.zeros(len(self._rows), dtype=torch.bool))
        return finished

    # ------------------------------------------------------------------ internals

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of each row's last position [b, V], and the routes [b, s, L, k] with a recorder."""
        device = self._device
        logits = self._model(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        ).logits[:, -1, :].cpu()  # [b, V]
        routes = None if self._routes is None else self._routes.take(*input_ids.shape)
        return logits, routes

    def _join(self, rows: Sequence[DecodeRow], cache: DynamicCache, mask: torch.Tensor,
              context_routes: list[torch.Tensor] | None = None) -> None:
        """Append the prefilled rows to the batch (their cache after the running rows')."""
        slots = torch.tensor([self._free_slots.pop() for _ in rows], dtype=torch.long)
        if context_routes is not None:
            for slot, routes in zip(slots.tolist(), context_routes, strict=True):
                self._ctx_routes[slot] = routes
        self._out_ids[slots] = 0
        self._out_lps[slots] = 0.0
        for slot, row in zip(slots.tolist(), rows):
            if row.prefix:
                self._out_ids[slot, : len(row.prefix)] = torch.tensor(row.prefix, dtype=torch.long)
                self._out_lps[slot, : len(row.prefix)] = torch.tensor(row.prefix_logprobs, dtype=torch.float64)
        if self._cache is None or not self._rows:
            # The running cache lives in preallocated buffers (rollout/local/kv_rows.py).
            running = DynamicCache(config=self._model.config)
            running.layers = [RowBufferLayer(self.max_rows) for _ in cache.layers]
            self._cache, self._mask = running, mask.new_zeros(0, 0)
        for layer, new in zip(self._cache.layers, cache.layers, strict=True):
            if type(new) is not DynamicLayer:
                raise TypeError(f"continuous batching needs plain DynamicLayer caches, got {type(new).__name__}")
            layer.join(new.keys, new.values)
        width = max(self._mask.shape[1], mask.shape[1])
        self._mask = torch.cat([_left_pad_mask(self._mask, width), _left_pad_mask(mask, width)])
        self._rows.extend(rows)
        self._slots = torch.cat([self._slots, slots])
        self._seeds = torch.cat([self._seeds, torch.tensor([r.seed for r in rows], dtype=torch.long)])
        self._counts = torch.cat([self._counts, torch.tensor([len(r.prefix) for r in rows], dtype=torch.long)])
        self._limits = torch.cat([self._limits, torch.tensor([r.limit for r in rows], dtype=torch.long)])
        self._next_ids = torch.cat([self._next_ids, torch.zeros(len(rows), dtype=torch.long)])

    def _sample_and_retire(self, logits: torch.Tensor) -> list[FinishedRow]:
        params = self._params
        uniforms = None if params.greedy else counter_uniforms(self._seeds, self._counts)
        tokens, logprobs = sample_next_tokens(
            logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, uniforms=uniforms
        )
        self._out_ids[self._slots, self._counts] = tokens
        self._out_lps[self._slots, self._counts] = logprobs
        self._counts = self._counts + 1
        self._next_ids = tokens
        stopped = torch.isin(tokens, self._stop_ids)
        done = stopped | (self._counts >= self._limits)
        if not bool(done.any()):
            return []
        finished = [self._finished(b, "stop" if stopped[b] else "length") for b in torch.nonzero(done)[:, 0].tolist()]
        self._keep(~done)
        return finished

    def _finished(self, b: int, reason: FinishReason) -> FinishedRow:
        slot, count = int(self._slots[b]), int(self._counts[b])
        row = self._rows[b]
        routes = None
        if self._routes is not None:  # the context's prefill, then each response token fed since
            fed = self._out_routes[slot, len(row.prefix):max(count - 1, len(row.prefix))]
            routes = torch.cat([self._ctx_routes[slot], fed]).numpy()
        return FinishedRow(row=row, output_ids=self._out_ids[slot, :count].tolist(),
                           logprobs=self._out_lps[slot, :count].tolist(), finish_reason=reason,
                           routed_experts=routes)

    def _keep(self, keep: torch.Tensor) -> None:
        """Keep the rows where `keep` is True; free the others' slots and cache rows.

        The last running rows move into the places of the leaving ones, so only those are
        copied; the batch order changes accordingly (every per-row array follows it).
        """
        self._free_slots.extend(self._slots[~keep].tolist())
        remaining = int(keep.sum())
        holes = [b for b in range(remaining) if not keep[b]]
        movers = [b for b in range(remaining, len(self._rows)) if keep[b]]
        order = list(range(remaining))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        index = torch.tensor(order, dtype=torch.long)
        self._rows = [self._rows[b] for b in order]
        self._slots, self._seeds = self._slots[index], self._seeds[index]
        self._counts, self._limits, self._next_ids = self._counts[index], self._limits[index], self._next_ids[index]
        self._mask = self._mask[index]
        if not self._rows:
            self._cache = None
            self._mask = torch.zeros(0, 0, dtype=torch.long)
            return
        assert self._cache is not None
        used = torch.nonzero(self._mask.any(0))[:, 0]
        first = int(used[0]) if used.numel() else 0
        self._mask = self._mask[:, first:]
        for layer in self._cache.layers:
            layer.move_rows(holes, movers, remaining)
            if first > 0:  # columns only rows that left had used
                layer.drop_left(first)


def _left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    return mask if missing == 0 else torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)
