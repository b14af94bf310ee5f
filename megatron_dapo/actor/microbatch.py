"""Token-budget micro-batches and token-balanced data-parallel shards (pure torch).

Step 4 of the RL step splits the batch over data-parallel ranks by token count
(`balance_across_dp`); steps 5 and 6 then cut each rank's share into micro-batches
under `trainer.max_tokens_per_microbatch` (`pack_microbatches`) and turn each group of
sequences into model inputs (`build_microbatch`).

Responses have very different lengths (a few hundred to 20k tokens), so a fixed number
of sequences per micro-batch either wastes memory on padding or runs out of it. A token
budget keeps the peak activation memory of every micro-batch about the same.

Two input layouts:
- padded (CPU, and GPU without Transformer Engine): `[n, S]` right-padded rows, causal
  attention. Right padding never changes a real token's output under a causal mask, so
  no attention mask is needed, and the budget counts padded tokens (n x longest).
- packed (GPU with TE, `packed=True`): all sequences concatenated into `[1, sum L]`
  with PackedSeqParams (qkv_format "thd") marking sequence boundaries, no padding; the
  budget counts real tokens. Per-token results are mapped back to `[n, S]` rows so the
  loss code is the same in both layouts.

Every data-parallel rank must run the same number of micro-batches, because each
micro-batch's forward/backward runs tensor- and pipeline-parallel collectives and the
DDP gradient reduction waits for all ranks. `pack_microbatches(num_microbatches=k)`
reaches exactly k by splitting the fullest micro-batches and, only when every
micro-batch already holds one sequence, appending empty ones; an empty micro-batch is
one padding token with no loss (`build_microbatch` of no indices).

Sequence parallelism (and later context parallelism) splits the model's sequence
dimension over ranks, so `build_microbatch(pad_to_multiple=k)` pads the micro-batch's
sequence length (padded: the row width; packed: the packed length, the padding joining
the last sequence, which causal attention keeps out of its real tokens) and the empty
filler to a multiple of k. Padded positions are invalid: no loss, no log-prob.

Token alignment: every per-token tensor of a RolloutBatch is indexed like `input_ids`
(value at t belongs to token t). The model's output at position t predicts token t+1, so
the micro-batch's loss-side tensors are shifted by one: row position t holds the values
of token t+1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_dapo.models.shared_prompts import SharedPromptParams

__all__ = [
    "MicroBatch",
    "RolloutBatch",
    "balance_across_dp",
    "build_microbatch",
    "pack_microbatches",
]


@dataclass(kw_only=True, slots=True)
class RolloutBatch:
    """Sequences (prompt + response) of one rank, right-padded, with their per-token data."""

    input_ids: torch.Tensor
    """[B, S] int64 prompt + response token ids, right-padded (pad value irrelevant)."""
    seq_lens: torch.Tensor
    """[B] int64 real length of each row (prompt + response)."""
    response_mask: torch.Tensor
    """[B, S] bool: token t is a response token whose log-prob enters the loss."""
    old_log_probs: torch.Tensor | None = None
    """[B, S] fp32 log-probs of the policy that generated the batch (step 5)."""
    advantages: torch.Tensor | None = None
    """[B, S] fp32 per-token advantages (the group-relative advantage of the row)."""
    ref_log_probs: torch.Tensor | None = None
    """[B, S] fp32 log-probs of the reference policy (only with the KL loss)."""
    is_weights: torch.Tensor | None = None
    """[B, S] fp32 rollout-correction weights of each token's loss (None = 1)."""
    routes: torch.Tensor | None = None
    """[B, S, L, k] int16 expert ids of token t in each MoE layer, the engine's (rollout/routes.py)
    or the old-log-prob pass's; -1 where there is none (padding, each row's last token)."""
    replay_routes: torch.Tensor | None = None
    """[B, S, L, k] int16 the routes the actor's forward passes replay (algorithm.routing_replay:
    the engine's for `rollout`, the old-log-prob pass's for `old_policy`); None = free routing."""

    def __post_init__(self) -> None:
        num_seqs, seq_len = self.input_ids.shape
        if self.seq_lens.shape != (num_seqs,):
            raise ValueError(f"seq_lens has shape {tuple(self.seq_lens.shape)}, expected ({num_seqs},)")
        if num_seqs and (int(self.seq_lens.min()) < 1 or int(self.seq_lens.max()) > seq_len):
            raise ValueError(f"seq_lens must lie in [1, {seq_len}] (the padded width), got "
                             f"min {int(self.seq_lens.min())} max {int(self.seq_lens.max())}")
        for name in ("response_mask", "old_log_probs", "advantages", "ref_log_probs", "is_weights"):
            value = getattr(self, name)
            if value is not None and value.shape != self.input_ids.shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}; every per-token tensor must "
                                 f"match input_ids {tuple(self.input_ids.shape)}")
        for name in ("routes", "replay_routes"):
            value = getattr(self, name)
            if value is not None and (value.dim() != 4 or value.shape[:2] != self.input_ids.shape):
                raise ValueError(f"{name} has shape {tuple(value.shape)}; expected [B, S, L, k] with [B, S] = "
                                 f"{tuple(self.input_ids.shape)}")

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]

    def select(self, indices: Sequence[int]) -> RolloutBatch:
        """The rows `indices`, trimmed to their longest sequence."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        width = int(self.seq_lens[idx].max()) if len(idx) else 1

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx, :width]

        return RolloutBatch(
            input_ids=take(self.input_ids), seq_lens=self.seq_lens[idx], response_mask=take(self.response_mask),
            old_log_probs=take(self.old_log_probs), advantages=take(self.advantages),
            ref_log_probs=take(self.ref_log_probs), is_weights=take(self.is_weights), routes=take(self.routes),
            replay_routes=take(self.replay_routes),
        )


def balance_across_dp(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Split sequences over data-parallel ranks with nearly equal token totals.

    Greedy longest-processing-time: sequences in decreasing length (ties by index) each go
    to the rank with the fewest tokens so far (ties to the lowest rank). The first
    `dp_size` sequences land on distinct ranks, so every rank gets one when there are at
    least `dp_size` sequences. The largest total exceeds the optimum by at most one
    sequence's length. Deterministic: every rank computes the same split.

    Args:
        lengths: tokens (prompt + response) of each sequence.
        dp_size: number of data-parallel ranks.

    Returns:
        For each rank, the indices of its sequences in increasing order.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    loads = [0] * dp_size
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        shards[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(s) for s in shards]


def _cost(lengths: Sequence[int], members: list[int], padded: bool,
          prompts: Sequence[tuple[int, int]] | None = None) -> int:
    if not members:
        return 0
    if padded:
        return max(lengths[i] for i in members) * len(members)
    total = sum(lengths[i] for i in members)
    if prompts is not None:  # a prompt held by k rows goes through the model once, not k times
        seen: dict[int, int] = {}
        for i in members:
            key, plen = prompts[i]
            if key in seen:
                total -= plen
            seen[key] = plen
    return total


def pack_microbatches(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    padded: bool = True,
    num_microbatches: int | None = None,
    prompts: Sequence[tuple[int, int]] | None = None,
) -> list[list[int]]:
    """Group sequences into micro-batches of at most `max_tokens` tokens (first-fit decreasing).

    Sequences are placed longest first (ties by index) into the first micro-batch where
    they fit. A sequence longer than the budget on its own gets a micro-batch of its own
    (the budget bounds grouping, it never truncates); its memory is the sequence's.
    With `prompts` (the shared-prompt layout) the rows of one prompt are placed one after
    another, largest group first, so that they meet in one micro-batch where the budget
    allows, and a prompt counts once per micro-batch.

    Args:
        lengths: tokens (prompt + response) of each sequence.
        max_tokens: the budget; counts padded tokens (n x longest) when `padded`, else real tokens.
        padded: the padded `[n, S]` layout (True) or the packed thd layout (False).
        prompts: per sequence (prompt id, prompt length), rows with the same id sharing the
            prompt; the shared-prompt layout's cost (packed, each prompt once). None: no sharing.
        num_microbatches: if given, return exactly this many micro-batches (>= the natural
            count, e.g. the maximum over data-parallel ranks): the costliest micro-batches
            with two or more sequences are split in two, then empty ones appended.

    Returns:
        Micro-batches as lists of sequence indices; a micro-batch may be empty only when
        `num_microbatches` asked for more than the sequences allow.

    Raises:
        ValueError: for a non-positive budget, or `num_microbatches` below the natural count.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1 (trainer.max_tokens_per_microbatch)")
    if prompts is not None and padded:
        raise ValueError("prompts= describes the shared-prompt layout, which is packed; pass padded=False")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if prompts is not None:
        group_cost: dict[int, int] = {}
        first: dict[int, int] = {}
        for i, (key, plen) in enumerate(prompts):
            group_cost[key] = group_cost.get(key, plen) + lengths[i] - plen
            first.setdefault(key, i)
        order = sorted(range(len(lengths)), key=lambda i: (-group_cost[prompts[i][0]], first[prompts[i][0]],
                                                           -lengths[i], i))
    bins: list[list[int]] = []
    for i in order:
        for members in bins:
            if _cost(lengths, [*members, i], padded, prompts) <= max_tokens:
                members.append(i)
                break
        else:
            bins.append([i])
    if num_microbatches is None:
        return bins
    if num_microbatches < len(bins):
        raise ValueError(f"num_microbatches={num_microbatches} is below the {len(bins)} micro-batches "
                         f"the budget max_tokens={max_tokens} needs; pass the maximum over ranks")
    while len(bins) < num_microbatches:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            bins.extend([] for _ in range(num_microbatches - len(bins)))
            break
        b = max(splittable, key=lambda b: (_cost(lengths, bins[b], padded, prompts), -b))
        if prompts is None:
            # Alternate members (they are in decreasing length) so both halves cost about the same.
            bins[b], extra = bins[b][0::2], bins[b][1::2]
        else:  # members are grouped by prompt: cut in the middle, splitting at most one group
            half = len(bins[b]) // 2
            bins[b], extra = bins[b][:half], bins[b][half:]
        bins.insert(b + 1, extra)
    return bins


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    """Model inputs of one micro-batch and its loss-side tensors as `[n, S]` rows.

    Row position t describes the prediction made at token t, i.e. of token t+1.
    """

    indices: list[int]
    """Rows of the source RolloutBatch, in row order; empty for a padding micro-batch."""
    input_ids: torch.Tensor
    """Model tokens: [n, S] padded, or [1, sum L] packed."""
    position_ids: torch.Tensor
    """Positions, same shape as input_ids (restarting at 0 per sequence when packed)."""
    targets: torch.Tensor
    """[n, S] int64 the token predicted at each position (0 where there is none)."""
    valid: torch.Tensor
    """[n, S] bool: the position predicts a real next token of its sequence."""
    loss_mask: torch.Tensor
    """[n, S] bool: the predicted token is a response token (valid & response_mask shifted)."""
    old_log_probs: torch.Tensor | None
    """[n, S] fp32 or None, shifted like targets."""
    advantages: torch.Tensor | None
    """[n, S] fp32 or None, shifted like targets."""
    ref_log_probs: torch.Tensor | None
    """[n, S] fp32 or None, shifted like targets."""
    is_weights: torch.Tensor | None
    """[n, S] fp32 or None, shifted like targets."""
    flat_index: torch.Tensor | None
    """Packed only: [sum L] position of each packed token in the flattened [n, S] rows."""
    cu_seqlens: torch.Tensor | None
    """Packed only: [n + 1] int32 cumulative sequence lengths."""
    source_index: torch.Tensor | None = None
    """Shared-prompt only: [n, S] int64 the model position whose output predicts row position
    (r, t), several rows pointing at the same position of their shared prompt (0 where invalid)."""
    shared: SharedPromptParams | None = None
    """Shared-prompt only: the segment structure the attention needs (actor/shared_layout.py)."""
    routes: torch.Tensor | None = None
    """[n, S, L, k] the engine's routes of token t (not shifted; actor/route_layout.py), or None."""
    replay_routes: torch.Tensor | None = None
    """[n, S, L, k] the routes to replay for token t (not shifted), or None (free routing)."""

    @property
    def packed(self) -> bool:
        return self.flat_index is not None

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position model results (flattened over input_ids) as [n, S] rows.

        Args:
            values: [input_ids.numel()] one value per model position.

        Returns:
            [n, S] values; positions without a token (padding) hold 0.
        """
        if self.flat_index is None:
            return values.view(self.targets.shape)
        rows = values.new_zeros(self.targets.numel())
        return rows.index_copy(0, self.flat_index, values).view(self.targets.shape)

    def packed_seq_params(self) -> PackedSeqParams | None:
        """PackedSeqParams (thd) for GPTModel.forward; None in the padded layout."""
        if self.shared is not None:
            return self.shared
        if self.cu_seqlens is None:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        max_len = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=max_len, max_seqlen_kv=max_len)


def _shift(t: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor | None:
    """Value of token t+1 at position t; 0 where position t predicts nothing."""
    if t is None:
        return None
    shifted = torch.zeros_like(t)
    shifted[:, :-1] = t[:, 1:]
    return shifted.masked_fill_(~valid, 0)


def _pad_width(batch: RolloutBatch, width: int) -> RolloutBatch:
    """`batch` right-padded to `width` columns (the padding is outside every sequence)."""
    extra = width - batch.input_ids.shape[1]
    if extra == 0:
        return batch

    def pad(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.nn.functional.pad(t, (0, extra))

    def pad_routes(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.cat([t, t.new_full((t.shape[0], extra, *t.shape[2:]), -1)], dim=1)

    return RolloutBatch(
        input_ids=pad(batch.input_ids), seq_lens=batch.seq_lens, response_mask=pad(batch.response_mask),
        old_log_probs=pad(batch.old_log_probs), advantages=pad(batch.advantages),
        ref_log_probs=pad(batch.ref_log_probs), is_weights=pad(batch.is_weights), routes=pad_routes(batch.routes),
        replay_routes=pad_routes(batch.replay_routes),
    )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_microbatch(batch: RolloutBatch, indices: Sequence[int], *, packed: bool = False,
                     pad_to_multiple: int = 1) -> MicroBatch:
    """Model inputs and shifted loss tensors for the rows `indices` of `batch`.

    Args:
        batch: this rank's sequences.
        indices: rows of `batch` in this micro-batch; empty = a padding micro-batch of
            `pad_to_multiple` tokens that contributes no loss (keeps ranks in lockstep).
        packed: build the thd layout ([1, sum L] tokens + cu_seqlens) instead of padded rows.
        pad_to_multiple: the model's sequence length (padded: the row width; packed: the
            packed length) is made a multiple of this (the TP size under sequence parallelism).

    Returns:
        The MicroBatch, on the device of `batch.input_ids`.
    """
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple={pad_to_multiple} must be >= 1")
    indices = list(indices)
    if not indices:
        device = batch.input_ids.device
        one = torch.zeros(1, pad_to_multiple, dtype=torch.long, device=device)
        no = torch.zeros(1, pad_to_multiple, dtype=torch.bool, device=device)
        zero = torch.zeros(1, pad_to_multiple, dtype=torch.float32, device=device)
        return MicroBatch(
            indices=[], input_ids=one, position_ids=one.clone(), targets=one.clone(), valid=no, loss_mask=no.clone(),
            old_log_probs=None if batch.old_log_probs is None else zero,
            advantages=None if batch.advantages is None else zero.clone(),
            ref_log_probs=None if batch.ref_log_probs is None else zero.clone(),
            is_weights=None if batch.is_weights is None else zero.clone(),
            flat_index=None, cu_seqlens=None,
        )
    sub = batch.select(indices)
    if not packed:
        sub = _pad_width(sub, _round_up(sub.input_ids.shape[1], pad_to_multiple))
    num_seqs, width = sub.input_ids.shape
    positions = torch.arange(width, device=sub.input_ids.device)
    # Position t predicts token t+1, which exists for t < L - 1.
    valid = positions.unsqueeze(0) < (sub.seq_lens.unsqueeze(1) - 1)
    targets = _shift(sub.input_ids, valid)
    loss_mask = _shift(sub.response_mask, valid)
    position_ids = positions.unsqueeze(0).expand(num_seqs, width).contiguous()
    flat_index = cu_seqlens = None
    input_ids = sub.input_ids
    if packed:
        real = (positions.unsqueeze(0) < sub.seq_lens.unsqueeze(1)).reshape(-1)  # [n*S]
        flat_index = torch.nonzero(real).squeeze(-1)
        input_ids = input_ids.reshape(-1)[flat_index].unsqueeze(0)  # [1, sum L]
        position_ids = position_ids.reshape(-1)[flat_index].unsqueeze(0)
        cu_seqlens = torch.zeros(num_seqs + 1, dtype=torch.int32, device=input_ids.device)
        cu_seqlens[1:] = torch.cumsum(sub.seq_lens, 0)
        extra = _round_up(input_ids.shape[1], pad_to_multiple) - input_ids.shape[1]
        if extra:
            input_ids = torch.nn.functional.pad(input_ids, (0, extra))
            last = int(position_ids[0, -1]) + 1
            tail = torch.arange(last, last + extra, device=position_ids.device).unsqueeze(0)
            position_ids = torch.cat([position_ids, tail], dim=1)
            cu_seqlens[-1] += extra
    return MicroBatch(
        indices=indices, input_ids=input_ids, position_ids=position_ids, targets=targets, valid=valid,
        loss_mask=loss_mask.bool(), old_log_probs=_shift(sub.old_log_probs, valid),
        advantages=_shift(sub.advantages, valid), ref_log_probs=_shift(sub.ref_log_probs, valid),
        is_weights=_shift(sub.is_weights, valid), flat_index=flat_index, cu_seqlens=cu_seqlens,
        routes=sub.routes, replay_routes=sub.replay_routes,
    )
