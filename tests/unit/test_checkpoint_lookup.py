"""Checkpoint lookup, resume resolution, validation messages and RNG capture, without megatron models."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_dapo.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointManager,
    atomic_write_text,
    capture_rng_state,
    latest_checkpoint,
    read_manifest,
    resolve_resume,
    restore_rng_state,
)
from megatron_dapo.convert import parse_size
from megatron_dapo.errors import UserError


def _fake_ckpt(root: Path, name: str, complete: bool = True) -> Path:
    path = root / name
    (path / "dist").mkdir(parents=True)
    if complete:
        (path / "manifest.json").write_text(json.dumps({"format_version": FORMAT_VERSION}))
    return path


def test_latest_follows_pointer_and_falls_back_to_newest_complete(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "absent") is None
    assert latest_checkpoint(tmp_path) is None
    for name in ("step_2", "step_10"):
        _fake_ckpt(tmp_path, name)
    _fake_ckpt(tmp_path, "step_11", complete=False)
    _fake_ckpt(tmp_path, ".tmp-step_12", complete=False)
    # No pointer: newest complete by number (10 > 2 although "10" < "2" as text).
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"
    (tmp_path / "latest").write_text("step_2\n")
    # A newer complete checkpoint than the pointer means a kill between rename and pointer update.
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"
    (tmp_path / "latest").write_text("step_10\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"
    (tmp_path / "latest").write_text("step_99\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"


def test_a_latest_pointer_that_is_not_utf8_is_stale_and_the_newest_complete_step_resumes(tmp_path: Path) -> None:
    _fake_ckpt(tmp_path, "step_2")
    newest = _fake_ckpt(tmp_path, "step_4")
    (tmp_path / "latest").write_bytes(b"step_\xff\xfe2\n")
    assert latest_checkpoint(tmp_path) == newest
    assert resolve_resume("auto", tmp_path) == newest


def test_resolve_resume_modes(tmp_path: Path) -> None:
    assert resolve_resume("disable", tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None
    _fake_ckpt(tmp_path, "step_3")
    assert resolve_resume("auto", tmp_path) == tmp_path / "step_3"
    with pytest.raises(CheckpointError) as err:
        resolve_resume(str(tmp_path / "nope"), tmp_path)
    assert str(err.value) == (
        f"no checkpoint at {tmp_path / 'nope'}: the directory does not exist; pass a step_<N> directory"
    )
    # An explicit root resolves to its latest, then is validated (here: dist/ files are missing).
    with pytest.raises(CheckpointError) as err:
        resolve_resume(str(tmp_path), tmp_path / "other")
    assert str(err.value).startswith(
        f"checkpoint {tmp_path / 'step_3'}: {tmp_path / 'step_3' / 'dist' / 'metadata.json'} is missing"
    )


def test_manifest_errors_name_the_file_and_fix(tmp_path: Path) -> None:
    tmp = _fake_ckpt(tmp_path, ".tmp-step_4", complete=False)
    with pytest.raises(
        CheckpointError, match=r"manifest.json is missing \(an unfinished save: use an earlier"
    ):
        read_manifest(tmp)
    bad = _fake_ckpt(tmp_path, "step_5")
    (bad / "manifest.json").write_text('{"format_version": ')
    with pytest.raises(CheckpointError, match=r"step_5/manifest.json is corrupted \(Expecting value"):
        read_manifest(bad)
    (bad / "manifest.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(CheckpointError) as err:
        read_manifest(bad)
    assert f"format_version 99 in {bad / 'manifest.json'}, this megatron-dapo reads {FORMAT_VERSION}" in str(
        err.value
    )
    assert isinstance(err.value, UserError)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_pickle_with_foreign_globals_is_refused(tmp_path: Path) -> None:
    ckpt = _fake_ckpt(tmp_path, "step_1")
    (ckpt / "dist" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (ckpt / "dist" / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError) as err:
        read_manifest(ckpt)
    assert (
        f"{ckpt / 'dist' / '.metadata'} is truncated or corrupted (UnpicklingError: refusing to load posix.system)"
        in str(err.value)
    )
    (ckpt / "dist" / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(CheckpointError, match=r"format 'zarr' in .*expected 'torch_dist'"):
        read_manifest(ckpt)


def test_prune_keeps_last_k_and_leftovers_are_cleaned(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _fake_ckpt(tmp_path, f"step_{step}")
    _fake_ckpt(tmp_path, ".tmp-step_5", complete=False)
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr._prune(keep=tmp_path / "step_4")
    mgr._clean_leftovers()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]
    with pytest.raises(CheckpointError, match="keep_last=-1 must be >= 0"):
        CheckpointManager(tmp_path, keep_last=-1)


def test_atomic_write_replaces_without_leftovers(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    atomic_write_text(target, "step_1\n")
    atomic_write_text(target, "step_2\n")
    assert target.read_text() == "step_2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_rng_state_round_trips_through_weights_only_load(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gauss in numpy's state
    path = tmp_path / "rng.pt"
    torch.save(capture_rng_state(), path)
    first = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    restore_rng_state(torch.load(path, weights_only=True))
    second = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    assert first[0] == second[0] and first[1] == second[1] and torch.equal(first[2], second[2])


@pytest.mark.parametrize(
    ("text", "size"),
    [("5GB", 5 * 10**9), ("512MiB", 512 * 2**20), ("100000", 100000), ("1.5kb", 1500), ("2G", 2 * 10**9)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_parse_size_rejects_garbage() -> None:
    with pytest.raises(UserError, match=r"--max-shard-size 'lots' is not a size; write e.g. 5GB"):
        parse_size("lots")


def test_convert_subparser_wires_both_directions() -> None:
    import argparse

    from megatron_dapo.convert import add_convert_subparser

    parser = argparse.ArgumentParser(prog="megatron-dapo")
    add_convert_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["convert", "hf-to-mcore", "--hf", "H", "--out", "O", "--tp", "2"])
    assert (args.hf, args.out, args.tp, args.pp, args.func.__name__) == ("H", "O", 2, 1, "_run_hf_to_mcore")
    args = parser.parse_args(
        ["convert", "mcore-to-hf", "--ckpt", "C", "--out", "O", "--max-shard-size", "1GB"]
    )
    assert (args.ckpt, args.hf_config_from, args.max_shard_size, args.func.__name__) == (
        "C",
        None,
        "1GB",
        "_run_mcore_to_hf",
    )
