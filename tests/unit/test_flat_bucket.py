"""Flattened weight buckets (SGLang's load_format="flattened_bucket"): our round trip always,
and sglang's own decoder on our payload where sglang imports (a venv with the wheel on CPU)."""

import importlib.util

import pytest
import torch

from megatron_dapo.rollout import flat_bucket
from megatron_dapo.rollout.flat_bucket import FLATTENED_BUCKET, encode_bucket, flatten_by_dtype, unflatten
from megatron_dapo.rollout.sglang.protocol import payload_text


def _bucket() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes, a transposed (non-contiguous) tensor, an empty one and tied embeddings."""
    torch.manual_seed(0)
    embed = torch.randn(10, 4).to(torch.bfloat16)
    return [
        ("model.embed_tokens.weight", embed),
        ("model.norm.weight", torch.randn(4)),
        ("model.layers.0.self_attn.o_proj.weight", torch.randn(6, 4).to(torch.bfloat16).t()),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(3, 5, dtype=torch.float16)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(0)),
        ("lm_head.weight", embed),  # tied: the same tensor under a second name
        ("model.layers.0.input_layernorm.weight", torch.randn(4)),
    ]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def test_flatten_round_trips_names_shapes_dtypes_and_bits_one_buffer_per_dtype():
    bucket = _bucket()
    flats = flatten_by_dtype(bucket)
    assert [f.tensor.dtype for f in flats] == [torch.bfloat16, torch.float32, torch.float16]
    assert all(f.tensor.dim() == 1 and f.tensor.is_contiguous() for f in flats)
    decoded = [pair for f in flats for pair in unflatten(f)]
    by_dtype_order = sorted(bucket, key=lambda p: [torch.bfloat16, torch.float32, torch.float16].index(p[1].dtype))
    assert [n for n, _ in decoded] == [n for n, _ in by_dtype_order]
    for (name, got), (_, want) in zip(decoded, by_dtype_order):
        assert _same_bits(got, want), name
    bf16 = flats[0]
    # The tied pair is stored once: both names point at one range, and the buffer holds 10*4 + 4*6 elements.
    embed, head = (e for e in bf16.entries if e.name in ("model.embed_tokens.weight", "lm_head.weight"))
    assert (embed.start_idx, embed.end_idx) == (head.start_idx, head.end_idx) == (0, 40)
    assert bf16.tensor.numel() == 40 + 24
    assert flats[1].tensor.numel() == 4 + 0 + 4 and flats[2].tensor.numel() == 15


def test_flat_buffer_is_a_copy_of_the_bucket():
    """The engines read the buffer after the export moved on: it must not alias the sources."""
    weight = torch.ones(4)
    (flat,) = flatten_by_dtype([("w", weight)])
    weight.zero_()
    assert torch.equal(flat.tensor, torch.ones(4))


def test_encode_bucket_sends_one_request_per_dtype_or_one_per_tensor_list():
    bucket = _bucket()
    flat = encode_bucket(bucket, FLATTENED_BUCKET)
    assert [(fmt, item.tensor.dtype) for fmt, item in flat] == [
        (FLATTENED_BUCKET, torch.bfloat16), (FLATTENED_BUCKET, torch.float32), (FLATTENED_BUCKET, torch.float16)]
    ((fmt, item),) = encode_bucket(bucket, "tensors")
    assert fmt is None and item == bucket


@pytest.mark.parametrize(("spec", "expected"), [("found", FLATTENED_BUCKET), (None, "tensors"), ("missing", "tensors")])
def test_flattened_format_only_where_sglang_has_the_tensor_bucket_module(monkeypatch, spec, expected):
    """sglang < 0.5.1 has no weight_sync.tensor_bucket (None); without sglang find_spec raises."""
    def find_spec(name):
        assert name == "sglang.srt.weight_sync.tensor_bucket"
        if spec == "missing":
            raise ModuleNotFoundError("No module named 'sglang'")
        return object() if spec == "found" else None

    monkeypatch.setattr(flat_bucket.importlib.util, "find_spec", find_spec)
    assert flat_bucket.default_weight_format() == expected


def _has_sglang_bucket() -> bool:
    try:
        return importlib.util.find_spec("sglang.srt.weight_sync.tensor_bucket") is not None
    except ImportError:
        return False


@pytest.mark.skipif(not _has_sglang_bucket(), reason="sglang (a GPU extra) is not installed: its decoder cannot run")
def test_sglang_own_decoder_reads_our_flattened_payload():
    """What an SGLang worker does with one entry of serialized_named_tensors, with sglang's code.

    Serialized without SGLang's CUDA reduction patch (it handles CUDA tensors only), so the
    CPU buffer travels as shared memory; the decode path (SafeUnpickler allowlist, bucket
    rebuild) is the server's own. The metadata conversion mirrors the server's
    ``_update_weights_from_flattened_bucket``, which rebuilds it field by field.
    """
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    bucket = _bucket()
    decoded = []
    for load_format, item in encode_bucket(bucket, FLATTENED_BUCKET):
        assert load_format == "flattened_bucket"
        text = payload_text(MultiprocessingSerializer.serialize(flat_bucket.to_sglang_wire(item), output_str=True))
        data = MultiprocessingSerializer.deserialize(text)
        metadata = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                            end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]
        decoded += FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                         metadata=metadata).reconstruct_tensors()
    want = dict(bucket)
    assert sorted(n for n, _ in decoded) == sorted(want)
    for name, tensor in decoded:
        assert _same_bits(tensor, want[name]), name
