"""Fused log-prob and entropy kernels for vocab-parallel logits on CUDA (Triton).

The GPU path of actor/logprobs.py. Both passes are bound by reading the logits (and, in
backward, writing their gradient): at T = 8k tokens and V = 152k a bf16 logits tensor is
2.5 GB, while the statistics are three floats per token. So each kernel streams one row
(token) of this rank's vocabulary slice through registers exactly once:

- forward: an online log-sum-exp in fp32 (running max m, S = sum exp(z - m) and
  U = sum exp(z - m) * z, rescaled by exp(m_old - m_new) once per block), plus z at the
  target id, with z = logits / T computed in fp32 (never a bf16 division);
- backward: p_j = exp(z_j - L) recomputed from the saved log-partition L, and
  grad z_j = g_lp (1[j = t] - p_j) - g_H p_j (log p_j + H), written in the logits' dtype.

No [T, V] intermediate is allocated: the extra memory is O(T). With tensor parallelism
each rank reduces its slice to (m, S, U, z_t) and :func:`combine_partial_stats` merges
them with one MAX and one packed SUM all-reduce, as the chunked path does. Megatron's
vocabulary padding columns (global id >= V) are outside the softmax and get gradient 0.

Imported only where triton is (CUDA machines); actor/logprobs.py falls back to the
chunked torch path elsewhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from megatron_dapo.actor.vocab_shard import num_real_columns

__all__ = ["BACKWARD_CONFIG", "FORWARD_CONFIG", "triton_log_probs_and_entropy"]

FORWARD_CONFIG = {"BLOCK": 8192, "num_warps": 8}
"""Columns per loop iteration and warps per row of the forward kernel (benchmarks/logprob_gpu.py)."""
BACKWARD_CONFIG = {"BLOCK": 8192, "num_warps": 8}
"""Same for the backward kernel."""


@triton.jit
def _forward_kernel(logits_ptr, target_ptr, m_ptr, s_ptr, u_ptr, zt_ptr, stride_row, num_real, vocab_start,
                    inv_temp, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    u = tl.zeros([], tl.float32)
    for start in range(0, num_real, BLOCK):
        cols = start + offs
        mask = cols < num_real
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp
        z = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)  # 0 on the first block (m = -inf), m_new is finite
        e = tl.exp(z - m_new)  # 0 on masked columns
        s = s * alpha + tl.sum(e, axis=0)
        u = u * alpha + tl.sum(e * x, axis=0)
        m = m_new
    local_t = tl.load(target_ptr + row) - vocab_start
    in_range = (local_t >= 0) & (local_t < num_real)
    zt = tl.load(base + local_t, mask=in_range, other=0.0).to(tl.float32) * inv_temp
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(u_ptr + row, u)
    tl.store(zt_ptr + row, tl.where(in_range, zt, 0.0))


@triton.jit
def _backward_kernel(logits_ptr, target_ptr, grad_ptr, log_z_ptr, entropy_ptr, g_lp_ptr, g_h_ptr, stride_row,
                     grad_stride_row, num_real, num_cols, vocab_start, inv_temp, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    out = grad_ptr + row * grad_stride_row
    offs = tl.arange(0, BLOCK)
    log_z = tl.load(log_z_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    g_lp = tl.load(g_lp_ptr + row)
    g_h = tl.load(g_h_ptr + row)
    local_t = tl.load(target_ptr + row) - vocab_start
    for start in range(0, num_cols, BLOCK):
        cols = start + offs
        real = cols < num_real
        x = tl.load(base + cols, mask=real, other=0.0).to(tl.float32)
        log_p = x * inv_temp - log_z
        p = tl.where(real, tl.exp(log_p), 0.0)
        grad_z = -p * (g_lp + g_h * (log_p + entropy))
        grad_z = tl.where(cols == local_t, grad_z + g_lp, grad_z)
        tl.store(out + cols, (grad_z * inv_temp).to(grad_ptr.dtype.element_ty), mask=cols < num_cols)


def combine_partial_stats(
    m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, zt: torch.Tensor, tp_group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge per-rank (max, sum exp, sum exp * z, z_target) of vocabulary slices into global stats.

    Args:
        m, s, u, zt: [T] fp32 of this rank's slice (zt is 0 where the target is elsewhere).
        tp_group: the tensor-parallel group, or None.

    Returns:
        (log_prob [T], entropy [T], log_partition [T]), identical on every rank.
    """
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        m_global = m.clone()
        dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=tp_group)
        scale = torch.exp(m - m_global)  # a slice of only padding has m = -inf: scale 0
        sums = torch.stack([s * scale, u * scale, zt], dim=-1)
        dist.all_reduce(sums, group=tp_group)
        m, (s, u, zt) = m_global, sums.unbind(-1)
    log_partition = m + torch.log(s)
    return zt - log_partition, log_partition - u / s, log_partition


class _TritonLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        target: torch.Tensor,
        temperature: float,
        tp_group: dist.ProcessGroup | None,
        vocab_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        num_tokens, num_cols = logits.shape
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        vocab_start = tp_rank * num_cols
        num_real = num_real_columns(vocab_start, num_cols, vocab_size)
        target = target.contiguous()
        stats = torch.empty(4, num_tokens, dtype=torch.float32, device=logits.device)
        if num_tokens:
            _forward_kernel[(num_tokens,)](
                logits, target, stats[0], stats[1], stats[2], stats[3], logits.stride(0), num_real, vocab_start,
                1.0 / temperature, BLOCK=FORWARD_CONFIG["BLOCK"], num_warps=FORWARD_CONFIG["num_warps"])
        log_prob, entropy, log_partition = combine_partial_stats(stats[0], stats[1], stats[2], stats[3], tp_group)
        ctx.save_for_backward(logits, target, log_partition, entropy)
        ctx.temperature = temperature
        ctx.vocab_start = vocab_start
        ctx.num_real = num_real
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_log_prob: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        logits, target, log_partition, entropy = ctx.saved_tensors
        if grad_log_prob is None and grad_entropy is None:
            return None, None, None, None, None
        zeros = torch.zeros_like(log_partition)
        g_lp = zeros if grad_log_prob is None else grad_log_prob.float().contiguous()
        g_h = zeros if grad_entropy is None else grad_entropy.float().contiguous()
        grad = torch.empty_like(logits)
        num_tokens, num_cols = logits.shape
        if num_tokens:
            _backward_kernel[(num_tokens,)](
                logits, target, grad, log_partition, entropy, g_lp, g_h, logits.stride(0), grad.stride(0),
                ctx.num_real, num_cols, ctx.vocab_start, 1.0 / ctx.temperature,
                BLOCK=BACKWARD_CONFIG["BLOCK"], num_warps=BACKWARD_CONFIG["num_warps"])
        return grad, None, None, None, None


def triton_log_probs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and entropy per token from this rank's vocabulary slice, fused (CUDA).

    Args:
        logits: [T, V/tp] CUDA logits, any float dtype; rows must be contiguous.
        target: [T] int64 global vocabulary ids.
        temperature: probabilities are softmax(logits / temperature), computed in fp32.
        tp_group: the tensor-parallel group the vocabulary is split over; None = no TP.
        vocab_size: the real vocabulary V; columns with global id >= V are padding.

    Returns:
        (log_prob [T], entropy [T]) fp32, differentiable in both (gradient in logits' dtype).
    """
    return _TritonLogProbEntropy.apply(logits, target, float(temperature), tp_group, vocab_size)
