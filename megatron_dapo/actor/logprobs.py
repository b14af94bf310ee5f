"""Log-probs of chosen tokens and entropy from vocab-parallel logits, in bounded memory.

Steps 5 and 6 of the RL step (old log-probs, then the loss) both start here: the last
pipeline stage holds logits `[T, V/tp]`, each tensor-parallel rank one slice of the
vocabulary, and the policy loss needs `log p(target)` per token and, for the entropy
bonus and the `actor/entropy` metric, the entropy of each token's distribution.

The obvious `log_softmax(logits.float())` materialises several fp32 `[T, V]` tensors
(the upcast, the softmax, its gradient). At T=16k tokens and V=152k (Qwen2.5) one of them
is 10 GB, so this module works on `chunk_size` tokens at a time: the forward keeps only
`[T]`-sized statistics (log-partition and entropy) per token, and the backward recomputes
the softmax of one chunk at a time from the saved logits. The extra memory beyond the
logits and their gradient is a few fp32 `[chunk_size, V/tp]` buffers, independent of T.

Temperature has the rollout engines' definition: probabilities are softmax(logits / t),
so the log-probs match what the engine sampled from.

Tensor parallelism follows megatron-core's vocab-parallel cross entropy: rank r holds
vocabulary ids [r * V/tp, (r + 1) * V/tp); a max and one packed sum are all-reduced per
chunk in forward, and the backward needs no communication because the saved per-token
statistics are already global.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_dapo.actor.vocab_shard import num_real_columns

__all__ = ["log_probs_and_entropy", "log_probs_from_logits", "te_parallel_cross_entropy_fn", "triton_log_probs_fn"]


def _tp_size_rank(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _chunk_stats(
    z: torch.Tensor,
    e: torch.Tensor,
    local_target: torch.Tensor,
    in_range: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global statistics of one chunk of temperature-scaled fp32 logits.

    Args:
        z: [c, V/tp] fp32 logits / temperature; overwritten (used as scratch).
        e: [c, V/tp] fp32 scratch buffer.
        local_target: [c] target ids shifted into this rank's slice (0 where out of range).
        in_range: [c] bool, the target id lies in this rank's slice.
        tp_group: the tensor-parallel group, or None.

    Returns:
        (log_prob [c], entropy [c], log_partition [c]) in fp32, identical on every TP rank.
    """
    tp_size, _ = _tp_size_rank(tp_group)
    if z.shape[1] == 0:  # this rank's slice is all vocabulary padding
        z_max = torch.full(z.shape[:1], float("-inf"), dtype=z.dtype, device=z.device)
    else:
        z_max = z.max(dim=-1).values
    if tp_size > 1:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp_group)
    target_z = torch.zeros_like(z_max)
    if z.shape[1] > 0:
        target_z = torch.where(in_range, z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)
    z.sub_(z_max.unsqueeze(-1))  # z - max: exp cannot overflow
    torch.exp(z, out=e)
    sum_exp = e.sum(-1)
    sum_exp_z = e.mul_(z).sum(-1)
    # Packing the three sums into one tensor makes it one all-reduce per chunk, not three.
    sums = torch.stack([sum_exp, sum_exp_z, target_z], dim=-1)  # [c, 3]
    if tp_size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
    sum_exp, sum_exp_z, target_z = sums.unbind(-1)
    log_sum_exp = torch.log(sum_exp)
    log_partition = z_max + log_sum_exp
    log_prob = target_z - log_partition
    # H = -sum p log p = log S - sum(e * (z - max)) / S, with e = exp(z - max) and S = sum e.
    entropy = log_sum_exp - sum_exp_z / sum_exp
    return log_prob, entropy, log_partition


def _scratch(num_tokens: int, chunk_size: int, num_cols: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    # Two fp32 [chunk, V/tp] buffers reused by every chunk: allocating fresh ones per chunk
    # costs page faults on CPU (and allocator churn on GPU) for every chunk.
    rows = min(chunk_size, num_tokens)
    return (torch.empty(rows, num_cols, dtype=torch.float32, device=device),
            torch.empty(rows, num_cols, dtype=torch.float32, device=device))


class _ChunkedLogProbEntropy(torch.autograd.Function):
    """log p(target) and entropy per token; backward recomputes the softmax chunk by chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        target: torch.Tensor,
        temperature: float,
        chunk_size: int,
        tp_group: dist.ProcessGroup | None,
        vocab_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, vocab_local = logits.shape
        _, tp_rank = _tp_size_rank(tp_group)
        vocab_start = tp_rank * vocab_local
        num_real = num_real_columns(vocab_start, vocab_local, vocab_size)
        log_prob = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(log_prob)
        log_partition = torch.empty_like(log_prob)
        z_buf, e_buf = _scratch(num_tokens, chunk_size, num_real, logits.device)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            # A copy into scratch, never in place: the caller's logits must stay intact.
            z = z_buf[: end - start].copy_(logits[start:end, :num_real]).div_(temperature)
            local, in_range = _local_target(target[start:end], vocab_start, num_real)
            log_prob[start:end], entropy[start:end], log_partition[start:end] = _chunk_stats(
                z, e_buf[: end - start], local, in_range, tp_group
            )
        del z_buf, e_buf
        ctx.save_for_backward(logits, target, log_partition, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.vocab_start = vocab_start
        ctx.num_real = num_real
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_log_prob: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        logits, target, log_partition, entropy = ctx.saved_tensors
        if grad_log_prob is None and grad_entropy is None:
            return None, None, None, None, None, None
        num_tokens, vocab_local = logits.shape
        num_real = ctx.num_real
        # Padding columns take no part in the softmax: their gradient is exactly zero.
        grad_logits = torch.empty_like(logits) if num_real == vocab_local else torch.zeros_like(logits)
        z_buf, p_buf = _scratch(num_tokens, ctx.chunk_size, num_real, logits.device)
        for start in range(0, num_tokens, ctx.chunk_size):
            end = min(start + ctx.chunk_size, num_tokens)
            z = z_buf[: end - start].copy_(logits[start:end, :num_real]).div_(ctx.temperature)
            # log p_j = z_j - L; p_j = exp(log p_j).
            log_p = z.sub_(log_partition[start:end].unsqueeze(-1))
            p = torch.exp(log_p, out=p_buf[: end - start])
            # d logp_t / dz_j = 1[j = t] - p_j
            # d H / dz_j     = -p_j (log p_j + H)
            # grad_z = g_lp (1[j=t] - p) - g_H p (log p + H)
            if grad_entropy is not None:
                g_h = grad_entropy[start:end].float().unsqueeze(-1)
                grad_z = log_p.add_(entropy[start:end].unsqueeze(-1)).mul_(g_h)
                if grad_log_prob is not None:
                    grad_z.add_(grad_log_prob[start:end].float().unsqueeze(-1))
                grad_z.mul_(p).neg_()
            else:
                grad_z = p.mul_(-grad_log_prob[start:end].float().unsqueeze(-1))
            if grad_log_prob is not None:
                local, in_range = _local_target(target[start:end], ctx.vocab_start, num_real)
                rows = torch.nonzero(in_range).squeeze(-1)
                grad_z[rows, local[rows]] += grad_log_prob[start:end][rows].float()
            grad_logits[start:end, :num_real] = grad_z.div_(ctx.temperature)
        del z_buf, p_buf
        return grad_logits, None, None, None, None, None


def _local_target(target: torch.Tensor, vocab_start: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    in_range = (target >= vocab_start) & (target < vocab_start + vocab_local)
    local = torch.where(in_range, target - vocab_start, 0)
    return local, in_range


def log_probs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int = 1024,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each token's distribution.

    Differentiable in both outputs; the backward recomputes the softmax one chunk at a
    time instead of keeping it. On CUDA with triton both passes are one fused kernel each
    (actor/triton_logprobs.py; MEGATRON_DAPO_LOGPROB_KERNEL=torch forces the chunked
    path). Call it on every rank of `tp_group` (it all-reduces).

    Args:
        logits: [T, V/tp] this rank's vocabulary slice of the logits, any float dtype.
        target: [T] int64 global vocabulary ids (every rank passes the same ids).
        temperature: probabilities are softmax(logits / temperature), as in the rollout.
        tp_group: the tensor-parallel group the vocabulary is split over; None = no TP.
        chunk_size: tokens processed at once; extra memory ~ 2 x chunk_size x V/tp x 4 bytes
            plus the gradient of the logits in backward.
        vocab_size: the real vocabulary V; columns with global id >= V are Megatron's
            padding and are left out of the softmax (gradient 0). None = all columns are real.

    Returns:
        (log_prob [T], entropy [T]), fp32, identical on every rank of `tp_group`.

    Raises:
        ValueError: for a non-positive temperature or chunk size, or mismatched shapes.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy rollouts use 1.0 for the actor)")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0; trainer.logprob_chunk_size sets it (e.g. 1024)")
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [T, V/tp] and target [T], got {tuple(logits.shape)} "
                         f"and {tuple(target.shape)}; flatten batch and sequence first")
    fused = triton_log_probs_fn() if logits.is_cuda else None
    if fused is not None:
        return fused(logits, target, temperature=float(temperature), tp_group=tp_group, vocab_size=vocab_size)
    return _ChunkedLogProbEntropy.apply(logits, target, float(temperature), int(chunk_size), tp_group, vocab_size)


LOGPROB_KERNEL_ENV = "MEGATRON_DAPO_LOGPROB_KERNEL"
"""auto (default): the Triton kernel on CUDA where triton imports; torch: always the chunked path."""


@functools.cache
def triton_log_probs_fn() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The fused Triton log-prob/entropy function, or None (no triton, or the chunked path is forced)."""
    if os.environ.get(LOGPROB_KERNEL_ENV, "auto") == "torch":
        return None
    try:
        from megatron_dapo.actor.triton_logprobs import triton_log_probs_and_entropy
    except ImportError:
        return None
    return triton_log_probs_and_entropy


TE_CROSS_ENTROPY_MIN_VERSION = "2.8"
"""Before TE 2.8, te_parallel_cross_entropy's backward read only grad_output[0] for a
per-token gradient (TE PR #2139): every token got row 0's gradient scale, and row 0 of a
micro-batch is a masked prompt token, so whole micro-batches got zero gradient."""


def te_cross_entropy_supported(version: str) -> bool:
    """Whether a Transformer Engine version has a per-token-correct fused cross entropy backward."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) >= Version(TE_CROSS_ENTROPY_MIN_VERSION)
    except InvalidVersion:
        return False


@functools.cache
def te_parallel_cross_entropy_fn() -> Callable[..., torch.Tensor] | None:
    """Transformer Engine's fused vocab-parallel cross entropy, or None (TE missing or < 2.8)."""
    try:
        import transformer_engine
        from megatron.core.extensions.transformer_engine import te_parallel_cross_entropy
    except ImportError:
        return None
    if not te_cross_entropy_supported(getattr(transformer_engine, "__version__", "0")):
        return None
    return te_parallel_cross_entropy


def _fused_log_probs(
    fused: Callable[..., torch.Tensor],
    logits: torch.Tensor,
    target: torch.Tensor,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
) -> torch.Tensor:
    """log p(target) through a fused cross-entropy kernel with TE's signature (x [s, b, v], target, group)."""
    # In fp32, as on the chunked path: bf16 logits / T rounded to bf16 moved log-probs by
    # 0.1-0.25 at T = 0.6-0.7, so old and new log-probs (one path each) disagreed on-policy.
    # The division also gives TE the fresh tensor it overwrites with the gradient.
    scaled = logits.float().div_(temperature).unsqueeze(1)  # [T, 1, V/tp], TE wants [s, b, v]
    _, tp_rank = _tp_size_rank(tp_group)
    num_real = num_real_columns(tp_rank * logits.shape[1], logits.shape[1], vocab_size)
    if num_real < logits.shape[1]:
        # exp(finfo.min - max) is exactly 0: padding columns get no mass and no gradient.
        scaled[..., num_real:] = torch.finfo(scaled.dtype).min
    loss = fused(scaled, target.unsqueeze(1), tp_group)  # [T, 1] = -log p
    return -loss.squeeze(1).float()


def log_probs_from_logits(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int = 1024,
    vocab_size: int | None = None,
    use_fused: bool = True,
) -> torch.Tensor:
    """Log-probability of each target token only (no entropy), differentiable.

    On CUDA with Transformer Engine >= 2.8 this is TE's fused parallel cross entropy (one
    kernel, gradient written in place); elsewhere the chunked path above.

    Args:
        logits: [T, V/tp] this rank's vocabulary slice.
        target: [T] int64 global vocabulary ids.
        temperature: probabilities are softmax(logits / temperature).
        tp_group: the tensor-parallel group, or None.
        chunk_size: tokens per chunk on the chunked path.
        vocab_size: the real vocabulary V (Megatron's padding columns excluded); None = all real.
        use_fused: allow the TE kernel when it is importable and the logits live on CUDA.

    Returns:
        log_prob: [T] fp32.
    """
    fused = te_parallel_cross_entropy_fn() if use_fused and logits.is_cuda else None
    if fused is None:
        return log_probs_and_entropy(
            logits, target, temperature=temperature, tp_group=tp_group, chunk_size=chunk_size,
            vocab_size=vocab_size,
        )[0]
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    return _fused_log_probs(fused, logits, target, temperature, tp_group, vocab_size)
