"""Which columns of a vocab-parallel logits slice are real tokens.

Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by x TP`; the
padding columns must stay out of every softmax. Both log-prob paths (logprobs.py, the
torch path, and triton_logprobs.py, the fused kernel) take this one definition.
"""

from __future__ import annotations


def num_real_columns(vocab_start: int, vocab_local: int, vocab_size: int | None) -> int:
    """Columns of this rank's slice that are real tokens, not Megatron's vocabulary padding.

    Args:
        vocab_start: the slice's first global column (tp_rank x vocab_local).
        vocab_local: columns in the slice (V/tp).
        vocab_size: the real vocabulary size; None = no padding.
    """
    if vocab_size is None:
        return vocab_local
    return max(0, min(vocab_local, vocab_size - vocab_start))
