"""Host-memory side of a run the GPU plan leaves out: checkpoint conversion and the weight export's transients.

Both were measured on the flagship's shapes at few layers (benchmarks/scale.py, issue 28)
and the formulas below are what those measurements follow (docs/benchmarks.md has the rows):

- **Conversion, one process** (convert.py streams, checkpoint/streaming.py): the process'
  imports, plus the largest thing alive at once: one tensor while hf-to-mcore writes (the
  vocab-padded embedding or output layer, V_pad x h), or one group while mcore-to-hf reads
  (a layer without its routed experts, or one expert). Nothing scales with the number of
  layers or experts.
- **Weight export per rank** (models/export.py): with receivers="all" (colocated engines)
  every rank of a TP x PP replica gets every full tensor; with receivers="controller" only
  rank 0 does, and the other ranks hold nothing beyond their parameters. A receiving rank
  holds, on top of its own parameters, the largest gathered tensor: the vocab matrices are
  gathered in place (V_pad x h once), every other tensor through a list of shards and a
  concatenation (twice its size: a gated fc1's gate and up, 2 x F x h each). At TP 1 nothing
  is gathered: a receiver holds the largest tensor it gets whole (another stage's, another EP
  rank's expert), and nothing at PP 1 x EP 1. The controller also holds one bucket
  (rollout.update_weights_bucket_megabytes).
- **Engine restarts** (rollout.max_engine_restarts > 0, colocated SGLang): each engine's leader
  rank keeps the last sync's full weights in host buffers reused by every sync, views of a few
  blocks pinned at their exact size beside a GPU (rollout/host_arena.py; rollout/sglang/colocated.py),
  so a restarted server reloads them: N x 2 B per leader, one copy, plus at most one block's tail
  (before issue 39 a fresh copy was made at each sync while the last one was kept: two; before
  issue 57 each tensor was pinned on its own, ~18k allocations that torch's pinned allocator
  rounds up to powers of two).
- **Routed experts** (algorithm.routing_replay on, SGLang): a server started with
  --enable-return-routed-experts keeps every KV slot's expert ids in a pinned host buffer of int32
  [KV tokens + a page, num_hidden_layers, k], one per TP worker (sglang 0.5.23
  model_runner.py, state_capturer/base.py).
"""

from __future__ import annotations

from megatron_dapo.plan.dims import ModelDims
from megatron_dapo.rollout.host_arena import BLOCK_BYTES

GIB = 1024**3
IMPORT_BASELINE_BYTES = int(0.47 * GIB)
"""RSS of a CPU process that imported torch 2.13 and megatron-core 0.16.1 and joined a gloo
group, before any weight (measured 2026-11-25: the converter's peak on a 6 MB checkpoint)."""


def padded_vocab(dims: ModelDims, tp: int, divisible_by: int = 128) -> int:
    """Megatron's vocab rows at TP ``tp``: V rounded up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-dims.vocab_size // multiple) * multiple


def largest_group_bytes(dims: ModelDims, bytes_per_param: int = 2) -> int:
    """The most parameter bytes the converter holds besides the vocab matrices: mcore-to-hf's group
    (a dense layer, or a sparse layer without its routed experts, or one expert, which it reads
    one by one), or hf-to-mcore's widest fc1 while it writes its halves (the whole 2F x h and one half)."""
    groups = [dims.layer_params(sparse=False)] if dims.num_moe_layers < dims.num_layers else []
    if dims.is_moe:
        groups += [dims.layer_params(sparse=True, experts=0), dims.expert_params()]
    widths = [dims.intermediate_size] if dims.num_moe_layers < dims.num_layers else []
    if dims.is_moe:
        widths.append(dims.moe_intermediate_size)
    fc1_halves = 3 * max(widths) * dims.hidden_size  # 2F x h whole + F x h half
    return max([*groups, fc1_halves]) * bytes_per_param


def converter_peak_bytes(dims: ModelDims, tp: int, bytes_per_param: int = 2) -> tuple[int, str]:
    """Peak RSS of one-process conversion (either direction) for the layout's tp, with its formula."""
    vocab = padded_vocab(dims, tp) * dims.hidden_size * bytes_per_param
    return (IMPORT_BASELINE_BYTES + max(vocab, largest_group_bytes(dims, bytes_per_param)),
            "imports 0.47 GiB + max(V_pad x h, a layer without its experts, one expert) x 2 B")


def export_transient_bytes(dims: ModelDims, tp: int, bytes_per_param: int = 2, *, pp: int = 1, ep: int = 1,
                           receivers: str = "all") -> tuple[int, str]:
    """Largest tensor memory a receiving rank holds while export_hf gathers (on top of its own parameters).

    Every rank of a replica with receivers="all"; the controller alone with receivers="controller"
    (the other ranks hold nothing). A tensor that needs no communication is a view of the
    parameter and costs nothing: at TP 1, PP 1 and EP 1 the export holds nothing extra.

    Args:
        dims: the model.
        tp: tensor-parallel size (shards gathered: the vocab in place, others via a concatenation).
        bytes_per_param: the parameters' dtype size.
        pp: pipeline stages (a receiver gets the other stages' tensors whole).
        ep: expert-parallel size (a receiver gets other ranks' experts, one at a time).
        receivers: "all" or "controller" (models/export.py).

    Returns:
        (bytes, formula).
    """
    vocab = padded_vocab(dims, tp) * dims.hidden_size * bytes_per_param
    widths = [dims.intermediate_size] if dims.num_moe_layers < dims.num_layers else []
    if dims.is_moe:
        widths.append(dims.moe_intermediate_size)
    fc1 = 2 * max(widths) * dims.hidden_size * bytes_per_param  # gate and up of the widest MLP
    if tp > 1:
        return max(vocab, 2 * fc1), "max(V_pad x h in place, 2 x fc1 (2F x h) via shards + concatenation) x 2 B"
    held = []
    if pp > 1:
        # The other stages' tensors arrive whole; the controller alone never receives its own
        # stage-0 embedding, so with tied embeddings it receives no vocab matrix at all.
        if receivers == "all" or not dims.tie_word_embeddings:
            held.append(vocab)
        held.append(fc1)
    if ep > 1 and dims.is_moe:
        held.append(2 * dims.moe_intermediate_size * dims.hidden_size * bytes_per_param)  # one expert's fc1
    formula = "TP 1: the largest tensor received whole (other stages' V x h or fc1, another rank's expert) x 2 B"
    return max(held, default=0), formula


RESTART_ARENA_TAIL_BYTES = BLOCK_BYTES
"""The most a leader's restart copy pins beyond the model's bytes: the unused tail of its last block
(rollout/host_arena.py; blocks grow from 64 MiB to 1 GiB)."""


def restart_copy_bytes(dims: ModelDims, bytes_per_param: int = 2) -> int:
    """Pinned host bytes an engine leader keeps for restarts: one copy of the whole model (all
    experts) in exactly pinned blocks, plus at most one block's unused tail (RESTART_ARENA_TAIL_BYTES)."""
    return dims.num_params() * bytes_per_param + RESTART_ARENA_TAIL_BYTES


def routes_buffer_bytes(dims: ModelDims, kv_tokens: int) -> int:
    """Pinned host bytes of one SGLang TP worker's routed-experts buffer: (KV tokens) x layers x k x 4 B.

    sglang 0.5.23 makes one per ModelRunner (model_runner.py `init_routed_experts_capturer`, a
    `RoutedExpertsCapturer` whose `BaseHostCache` is pinned, state_capturer/base.py), so an engine of
    TP t holds t of them."""
    return kv_tokens * dims.num_layers * dims.num_experts_per_tok * 4 if dims.is_moe else 0
