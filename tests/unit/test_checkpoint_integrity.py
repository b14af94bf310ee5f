"""Checkpoint checksums (megatron_dapo/checkpoint/integrity.py), one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.checkpoint.files import CheckpointError
from megatron_dapo.checkpoint.integrity import checksum_tree, verify_checksums


def _tree(root: Path) -> Path:
    (root / "dist").mkdir(parents=True)
    (root / "dist" / "__0_0.distcp").write_bytes(bytes(range(256)) * 100)
    (root / "trainer_state.json").write_text('{"step": 3}')
    (root / "manifest.json").write_text("{}")
    return root


def test_every_file_but_the_manifest_is_summed_and_verified(tmp_path: Path) -> None:
    root = _tree(tmp_path / "step_3")
    sums = checksum_tree(root)
    assert sorted(sums) == ["dist/__0_0.distcp", "trainer_state.json"]
    verify_checksums(root, {"checksums": sums})
    shard = root / "dist" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[12345] ^= 0x01  # one bit of tensor data
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step_3: dist/__0_0.distcp does not match its checksum"):
        verify_checksums(root, {"checksums": sums})
    (root / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match=r"dist/__0_0.distcp does not match its checksum .*\(\+1 more\)"):
        verify_checksums(root, {"checksums": sums})


def test_a_checkpoint_without_checksums_loads_unchecked(tmp_path: Path) -> None:
    root = _tree(tmp_path / "old")
    (root / "trainer_state.json").write_text("changed")  # no manifest checksums: nothing to compare
    assert verify_checksums(root, {"format_version": 1}) is None
