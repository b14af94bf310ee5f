"""The streaming converter's HF file halves: shards planned and written a tensor at a time, read without a memory map.

The mcore -> HF export and tools/make_shaped_checkpoint.py write through
StreamingShardWriter; the one-process HF -> mcore conversion reads with
HFCheckpoint(mapped=False). Both must be byte-for-byte what safetensors itself reads and writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_dapo.errors import UserError
from megatron_dapo.models.hf_checkpoint import HFCheckpoint
from megatron_dapo.models.hf_writer import INDEX_FILE, StreamingShardWriter, TensorSpec, plan_shards


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(10, 4, generator=g).to(torch.bfloat16),
        "norm": torch.randn(4, generator=g),
        "big": torch.randn(40, 4, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 5, generator=g).to(torch.float16),
    }


def test_plan_fills_in_order_and_gives_a_larger_tensor_a_shard_of_its_own() -> None:
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in _tensors().items()]
    plan = plan_shards(specs, max_shard_bytes=100)
    # embed 80 B + norm 16 B fit in 100; big (320 B) alone; half (30 B) starts the next.
    assert [[s.name for s in shard] for shard in plan] == [["embed", "norm"], ["big"], ["half"]]


def test_tensors_written_in_any_order_read_back_bit_exact(tmp_path: Path) -> None:
    tensors = _tensors()
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    writer = StreamingShardWriter(tmp_path, specs, max_shard_bytes=100)
    for name in reversed(list(tensors)):
        writer.write(name, tensors[name])
    files = writer.finish()
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    loaded = {}
    for f in files:
        loaded.update(load_file(f))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert index["weight_map"] == {"big": files[1].name, "embed": files[0].name, "half": files[2].name,
                                   "norm": files[0].name}
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_missing_or_misshapen_tensor_is_refused(tmp_path: Path) -> None:
    tensors = _tensors()
    writer = StreamingShardWriter(tmp_path, [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()],
                                  max_shard_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"tensor 'norm' is \(5,\) torch.float32, planned \(4,\)"):
        writer.write("norm", torch.zeros(5))
    writer.write("embed", tensors["embed"])
    with pytest.raises(ValueError, match="3 planned tensors were never written"):
        writer.finish()
    writer.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dim, start, stop", [(0, None, None), (0, 2, 7), (0, 9, 12), (1, 1, 3), (0, 10, 10)])
def test_unmapped_reads_equal_mapped_ones(tmp_path: Path, dim: int, start: int | None, stop: int | None) -> None:
    tensors = _tensors()
    save_file({"embed": tensors["embed"], "norm": tensors["norm"]}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    mapped, unmapped = HFCheckpoint(tmp_path), HFCheckpoint(tmp_path, mapped=False)
    a = mapped.read("embed", dim=dim, start=start, stop=stop)
    b = unmapped.read("embed", dim=dim, start=start, stop=stop)
    assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
    out = torch.zeros(a.shape, dtype=torch.float32)
    assert torch.equal(unmapped.read("embed", dim=dim, start=start, stop=stop, out=out), a.float())
    assert torch.equal(unmapped.read("norm"), tensors["norm"])


def test_unmapped_read_of_a_truncated_file_is_one_line(tmp_path: Path) -> None:
    save_file({"embed": _tensors()["embed"]}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ckpt = HFCheckpoint(tmp_path, mapped=False)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(UserError, match="ends inside tensor 'embed'; the file is truncated, re-download it"):
        ckpt.read("embed")
