"""Next-token sampling with temperature, top-k and top-p, exact in float64 (local engine).

Pure torch, no model: the local engine calls :func:`sample_next_tokens` once per decode
step. Everything is computed in float64 from the fp32 logits, so a test can recompute the
exact support and probabilities a token was drawn from.

Semantics (vLLM/flashinfer "top-k first" order, which SGLang 0.5.x uses on GPU):
1. ``logp = log_softmax(logits / T)`` over the full vocabulary; this is the reported
   log-prob (see engine.py for why it is taken before truncation);
2. top-k keeps the k most probable tokens (ties broken by token id, lower first);
3. the kept probabilities are renormalised and top-p keeps the shortest prefix, in
   descending order, whose mass reaches top_p: token r is kept when the mass of the tokens
   ranked before it is < top_p, so the most probable token is always kept;
4. one uniform ``u`` per row picks the token by inverse CDF over the kept, renormalised
   probabilities.
Temperature 0 takes the argmax (lowest id on ties) and reports ``log_softmax(logits)``.

Random numbers are counter-based (:func:`counter_uniforms`): the draw for token t of a
response is a pure function of the response's seed and t, SplitMix64's t-th output. So a
whole decode step draws for all rows in one tensor operation (one torch.Generator per row
cost a Python call per row and step), and a response samples the same tokens whichever
batch it decodes in, whenever it joins or leaves it.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic on signed ints)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1): the ``counters[r]``-th output of a SplitMix64 stream seeded by ``seeds[r]``.

    int64 multiplication wraps modulo 2^64 in torch, which is exactly SplitMix64's
    arithmetic on the same bits (tests compare with a pure-Python SplitMix64).

    Args:
        seeds: [B] int64 per-response seeds (engine.response_seed).
        counters: [B] int64 token index within each response (0 for the first token).

    Returns:
        [B] float64, the top 53 bits of each output scaled to [0, 1).
    """
    z = seeds.to(torch.int64) + (counters.to(torch.int64) + 1) * _int64(_GOLDEN)
    z = (z ^ _shift_right(z, 30)) * _int64(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _int64(_MIX2)
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).double() * 2.0**-53


def sample_next_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    uniforms: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and report its log-prob under the temperature-scaled softmax.

    Args:
        logits: [B, V] next-token logits (any float dtype).
        temperature: > 0 samples, 0 takes the argmax.
        top_k: keep the k most probable tokens; -1 = all.
        top_p: nucleus threshold in (0, 1]; 1 = off.
        uniforms: [B] float64 in [0, 1), one draw per row (e.g. counter_uniforms);
            ignored when temperature is 0.

    Returns:
        (tokens [B] int64, logprobs [B] float64).
    """
    z = logits.double()
    if temperature == 0:
        tokens = z.argmax(dim=-1)
        logp = torch.log_softmax(z, dim=-1)
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert uniforms is not None and uniforms.shape == z.shape[:1], "one uniform per row"
    logp = torch.log_softmax(z / temperature, dim=-1)  # [B, V]
    if top_p >= 1 and not 0 < top_k < z.shape[-1]:
        # Nothing is truncated: the inverse CDF in token-id order draws from the same
        # distribution without the [B, V] sort.
        kept_probs, order = logp.exp(), None
    else:
        kept_probs, order = truncated_distribution(logp, top_k=top_k, top_p=top_p)  # [B, V] sorted desc
    cdf = kept_probs.cumsum(dim=-1)  # [B, V]; flat after the kept prefix
    u = uniforms.to(torch.float64)
    pos = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    # u * total can round up to the total: clamp to the last token with mass.
    last = kept_probs.shape[-1] - 1 - (kept_probs.flip(-1) > 0).int().argmax(-1)
    pos = torch.minimum(pos, last)
    tokens = pos if order is None else order.gather(-1, pos.unsqueeze(-1)).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def truncated_distribution(
    logp: torch.Tensor, *, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k/top-p truncated distribution in descending probability order.

    Args:
        logp: [B, V] float64 log-probs (temperature already applied).
        top_k: keep the k most probable tokens; -1 = all.
        top_p: nucleus threshold in (0, 1].

    Returns:
        (probs [B, V] float64, renormalised, zero outside the kept prefix;
        order [B, V] int64 token id at each sorted position).
    """
    # Stable sort on -logp: equal probabilities keep ascending token id order.
    order = torch.sort(-logp, dim=-1, stable=True).indices
    probs = logp.gather(-1, order).exp()
    vocab = probs.shape[-1]
    if 0 < top_k < vocab:
        probs[:, top_k:] = 0
    probs = probs / probs.sum(-1, keepdim=True)
    if top_p < 1:
        mass_before = probs.cumsum(-1) - probs
        probs = torch.where(mass_before < top_p, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs, order
