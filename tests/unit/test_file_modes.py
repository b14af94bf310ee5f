"""Files a user shares keep the user's umask (safetensors' save_file and mkstemp/mkdtemp make 0600/0700)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatron_dapo.checkpoint.files import current_umask
from megatron_dapo.embedded import atomic_dir
from megatron_dapo.models.hf_writer import StreamingShardWriter, TensorSpec


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_current_umask_does_not_change_it(umask_022) -> None:
    assert current_umask() == 0o022
    assert current_umask() == 0o022


def test_exported_shards_are_readable_by_others(tmp_path: Path, umask_022) -> None:
    specs = [TensorSpec("a", (16,), torch.float32), TensorSpec("b", (16,), torch.float32)]
    writer = StreamingShardWriter(tmp_path, specs, max_shard_bytes=64)
    writer.write("a", torch.zeros(16))
    writer.write("b", torch.ones(16))
    files = writer.finish()
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # Before: 0600, as safetensors creates them.
    assert {oct(f.stat().st_mode & 0o777) for f in files} == {"0o644"}


def test_atomic_dir_is_created_with_the_umask(tmp_path: Path, umask_022) -> None:
    with atomic_dir(tmp_path / "cache") as tmp:
        (tmp / "x").write_text("1")
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == "0o755"
