"""The shared-prompt micro-batch layout: each prompt once, then each of its responses.

A micro-batch's rows are grouped by prompt (the tokens before the row's first response
token). A prompt held by two or more rows becomes one prefix segment followed by one
suffix segment per row (its response tokens); a row whose prompt is its own becomes a
single prefix segment. The segments are concatenated into `[1, T]` tokens without padding
(megatron's thd format), and models/shared_prompts.py gives every token the attention and
the RoPE position it has in its own padded row. What the layout saves is the (n - 1)
copies of every prompt in the linear layers, norms and activations, forward and backward;
on the tiny CPU run that is most of the actor's work.

Loss-side tensors stay `[n, S]` rows as in the other layouts (microbatch.MicroBatch):
`source_index[r, t]` is the packed position whose output predicts the row's token t + 1,
so the last prompt position of a shared prompt serves the first response token of every
row that shares it, each with its own target.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_dapo.actor.microbatch import MicroBatch, RolloutBatch, _round_up, _shift, build_microbatch
from megatron_dapo.models.shared_prompts import SharedPromptParams

__all__ = ["build_shared_microbatch", "prompt_groups", "uses_shared_prompts"]


def uses_shared_prompts(*, requested: bool, packed: bool, use_te: bool, cp: int, device_type: str) -> bool:
    """Whether the actor runs the shared-prompt layout (trainer.shared_prompts = `requested`).

    Only the local spec's attention runs it (not TE's, hence not with TE-packed batches),
    context parallelism splits padded rows, and only on CPU: there torch's SDPA takes the
    segments' boolean masks in its fused kernel, while on CUDA a mask together with
    grouped KV heads falls back to the math kernel (transformers' `use_gqa_in_sdpa` says
    as much), which stores every score matrix for backward, where the padded rows' causal
    attention runs flash attention.
    """
    return requested and not packed and not use_te and cp == 1 and device_type == "cpu"


def _prompt_lengths(batch: RolloutBatch) -> list[int]:
    """Tokens before each row's first response token (the whole row when it has none)."""
    mask = batch.response_mask.bool()
    width = mask.shape[1]
    first = torch.where(mask.any(dim=1), mask.int().argmax(dim=1), torch.full_like(batch.seq_lens, width))
    return torch.minimum(first, batch.seq_lens).tolist()


def prompt_groups(batch: RolloutBatch) -> list[tuple[int, int]]:
    """Per row (prompt id, prompt length): rows with equal prompt tokens get the same id.

    The id is the index of the first row with that prompt, so it is deterministic; a row
    whose response starts at its first token shares nothing.
    """
    lengths = _prompt_lengths(batch)
    width = max(lengths, default=0)
    prompts = batch.input_ids[:, :width].tolist()  # responses can be far longer
    # Rows share a prompt only where their routes of it agree too (an engine that prefilled the
    # prompt once per row may have routed it differently): one forward can replay only one.
    routes = [t[:, :width].cpu().numpy() for t in (batch.routes, batch.replay_routes) if t is not None]
    first: dict[tuple, int] = {}
    return [(first.setdefault((tuple(prompts[r][:plen]), *(t[r, :plen].tobytes() for t in routes)), r) if plen else r,
             plen) for r, plen in enumerate(lengths)]


def _padded_index(starts: Sequence[int], lens: Sequence[int], device: torch.device) -> torch.Tensor:
    """[len(starts), max(lens)] packed indices start + j, the tail repeating the segment's last token."""
    width = max(lens)
    offsets = torch.arange(width, device=device).unsqueeze(0)
    last = torch.tensor(lens, device=device).unsqueeze(1) - 1
    return torch.tensor(starts, device=device).unsqueeze(1) + torch.minimum(offsets, last)


def _buckets(lengths: Sequence[int]) -> list[list[int]]:
    """Segments grouped longest first so that each group's padded size is at most twice its real size."""
    buckets: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if buckets and (len(buckets[-1]) + 1) * lengths[buckets[-1][0]] <= 2 * (real + lengths[i]):
            buckets[-1].append(i)
            real += lengths[i]
        else:
            buckets.append([i])
            real = lengths[i]
    return buckets


def _place(out_index: torch.Tensor, offset: int, width: int, segments: list[tuple[int, int]]) -> int:
    """Point each segment's packed tokens at its row of a [len(segments), width] attention output."""
    for k, (start, length) in enumerate(segments):
        out_index[start:start + length] = torch.arange(offset + k * width, offset + k * width + length)
    return offset + len(segments) * width


def build_shared_microbatch(batch: RolloutBatch, indices: Sequence[int], *, pad_to_multiple: int = 1,
                            prompts: Sequence[tuple[int, int]] | None = None) -> MicroBatch:
    """Model inputs of the rows `indices` in the shared-prompt layout, loss tensors as `[n, S]` rows.

    Args:
        batch: this rank's sequences.
        indices: rows in this micro-batch; empty = a padding micro-batch (no loss).
        pad_to_multiple: the packed length is made a multiple of this (the TP size under
            sequence parallelism); the padding is a segment of its own.
        prompts: `prompt_groups(batch)` when the caller has it already (None: computed here).

    Returns:
        The MicroBatch, with `source_index` and `shared` set, on the device of batch.input_ids.
    """
    indices = list(indices)
    if not indices:
        return build_microbatch(batch, indices, pad_to_multiple=pad_to_multiple)
    sub = batch.select(indices)
    device = sub.input_ids.device
    num_rows, width = sub.input_ids.shape
    seq_lens = sub.seq_lens.tolist()
    groups = prompt_groups(sub) if prompts is None else [prompts[i] for i in indices]
    members: dict[int, list[int]] = {}  # prompt id -> rows of sub, in order of first appearance
    for r, (key, _) in enumerate(groups):
        members.setdefault(key, []).append(r)

    src_rows: list[int] = []  # each packed token's (row, column) in sub, flattened
    positions: list[int] = []
    prefix_starts: list[int] = []
    prefix_lens: list[int] = []
    suffix_starts: list[int] = []
    suffix_lens: list[int] = []
    suffix_parent: list[int] = []
    source = torch.zeros(num_rows, width, dtype=torch.long)

    def emit(row: int, lo: int, hi: int) -> int:
        start = len(positions)
        src_rows.extend(range(row * width + lo, row * width + hi))
        positions.extend(range(lo, hi))
        source[row, lo:hi] = torch.arange(start, start + hi - lo)
        return start

    for rows in members.values():  # in order of each prompt's first row
        plen = groups[rows[0]][1] if len(rows) > 1 else seq_lens[rows[0]]
        start = emit(rows[0], 0, plen)
        prefix_starts.append(start)
        prefix_lens.append(plen)
        for r in rows[1:]:
            source[r, :plen] = source[rows[0], :plen]
        for r in rows:
            if seq_lens[r] > plen:
                suffix_starts.append(emit(r, plen, seq_lens[r]))
                suffix_lens.append(seq_lens[r] - plen)
                suffix_parent.append(len(prefix_lens) - 1)

    real = len(positions)
    extra = _round_up(real, pad_to_multiple) - real
    input_ids = sub.input_ids.reshape(-1)[torch.tensor(src_rows, dtype=torch.long, device=device)]
    if extra:  # a segment of its own, attending only to itself
        input_ids = torch.nn.functional.pad(input_ids, (0, extra))
        prefix_starts.append(real)
        prefix_lens.append(extra)
        positions.extend(range(extra))
    total = real + extra

    # Segments of similar length share one attention call: padded sizes stay within twice
    # the real ones whatever the spread of lengths (one long response among short ones).
    out_index = torch.empty(total, dtype=torch.long)
    offset = 0
    prefix_index: list[torch.Tensor] = []
    for bucket in _buckets(prefix_lens):
        index = _padded_index([prefix_starts[p] for p in bucket], [prefix_lens[p] for p in bucket], device)
        prefix_index.append(index)
        offset = _place(out_index, offset, index.shape[1], [(prefix_starts[p], prefix_lens[p]) for p in bucket])
    suffix_index: list[torch.Tensor] = []
    suffix_kv_index: list[torch.Tensor] = []
    suffix_mask: list[torch.Tensor] = []
    for bucket in _buckets(suffix_lens):
        parents = [suffix_parent[q] for q in bucket]
        index = _padded_index([suffix_starts[q] for q in bucket], [suffix_lens[q] for q in bucket], device)
        prompt_lens = [prefix_lens[p] for p in parents]
        prompt = _padded_index([prefix_starts[p] for p in parents], prompt_lens, device)
        ls, lp = index.shape[1], prompt.shape[1]
        suffix_index.append(index)
        suffix_kv_index.append(torch.cat([prompt, index], dim=1))
        sees_prompt = torch.arange(lp, device=device).unsqueeze(0) < torch.tensor(prompt_lens, device=device).unsqueeze(1)
        causal = torch.ones(ls, ls, dtype=torch.bool, device=device).tril()
        suffix_mask.append(torch.cat([sees_prompt.unsqueeze(1).expand(-1, ls, -1),
                                      causal.unsqueeze(0).expand(len(bucket), -1, -1)], dim=2).unsqueeze(1))
        offset = _place(out_index, offset, ls, [(suffix_starts[q], suffix_lens[q]) for q in bucket])
    cu_seqlens = torch.tensor([0, total], dtype=torch.int32, device=device)
    max_len = max(positions) + 1
    shared = SharedPromptParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_len,
        max_seqlen_kv=max_len, prefix_index=prefix_index, suffix_index=suffix_index,
        suffix_kv_index=suffix_kv_index, suffix_mask=suffix_mask, out_index=out_index.to(device),
    )

    columns = torch.arange(width, device=device)
    valid = columns.unsqueeze(0) < (sub.seq_lens.unsqueeze(1) - 1)  # position t predicts token t + 1
    return MicroBatch(
        indices=indices, input_ids=input_ids.unsqueeze(0),
        position_ids=torch.tensor(positions, dtype=torch.long, device=device).unsqueeze(0),
        targets=_shift(sub.input_ids, valid), valid=valid, loss_mask=_shift(sub.response_mask, valid).bool(),
        old_log_probs=_shift(sub.old_log_probs, valid), advantages=_shift(sub.advantages, valid),
        ref_log_probs=_shift(sub.ref_log_probs, valid), is_weights=_shift(sub.is_weights, valid),
        flat_index=None, cu_seqlens=None, source_index=source.to(device), shared=shared,
        routes=sub.routes, replay_routes=sub.replay_routes,
    )
