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
4. one uniform ``u`` from the row's own generator picks the token by inverse CDF over the
   kept, renormalised probabilities.
Temperature 0 takes the argmax (lowest id on ties) and reports ``log_softmax(logits)``.
"""

from __future__ import annotations

import torch


def sample_next_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generators: list[torch.Generator] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and report its log-prob under the temperature-scaled softmax.

    Args:
        logits: [B, V] next-token logits (any float dtype).
        temperature: > 0 samples, 0 takes the argmax.
        top_k: keep the k most probable tokens; -1 = all.
        top_p: nucleus threshold in (0, 1]; 1 = off.
        generators: one CPU generator per row (ignored when temperature is 0).

    Returns:
        (tokens [B] int64, logprobs [B] float64).
    """
    z = logits.double()
    if temperature == 0:
        tokens = z.argmax(dim=-1)
        logp = torch.log_softmax(z, dim=-1)
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert generators is not None and len(generators) == z.shape[0], "one generator per row"
    logp = torch.log_softmax(z / temperature, dim=-1)  # [B, V]
    kept_probs, order = truncated_distribution(logp, top_k=top_k, top_p=top_p)  # [B, V] sorted desc
    cdf = kept_probs.cumsum(dim=-1)  # [B, V]; flat after the kept prefix
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])  # [B]
    pos = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    pos = torch.minimum(pos, (kept_probs > 0).sum(-1) - 1)  # u*total can round up to the total
    tokens = order.gather(-1, pos.unsqueeze(-1)).squeeze(-1)
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
