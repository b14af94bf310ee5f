"""The converters and `eval` run where the GPUs are (issue 39, item 1).

The one-process converters stream on megatron-core's CPU layer, which refuses a live CUDA runtime
(device.setup_device). These tests make CUDA look visible to the code that decides
(`torch.cuda.is_available()` answers True unless CUDA_VISIBLE_DEVICES is ''), as a GPU node would.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from model_utils import make_tiny_checkpoint

from megatron_dapo import cli
from megatron_dapo.device import hide_gpus_for_cpu_work, one_process


def _gpu_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA is visible until the process hides it, as the driver behaves before its first call."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: os.environ.get("CUDA_VISIBLE_DEVICES") != "")
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)


def test_one_process_follows_the_launchers():
    assert one_process({})
    assert one_process({"RANK": "0", "WORLD_SIZE": "1"})
    assert not one_process({"RANK": "0", "WORLD_SIZE": "2"})
    assert not one_process({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"})
    assert one_process({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})


def test_a_torchrun_rank_keeps_its_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert hide_gpus_for_cpu_work() is False
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_convert_both_ways_on_a_gpu_node(tmp_path: Path, monkeypatch):
    _gpu_node(monkeypatch)
    hf = make_tiny_checkpoint(tmp_path / "hf", "qwen2", num_layers=2, seed=1)
    # What failed before: the CPU layer next to (what looks like) a live CUDA runtime.
    from megatron_dapo.device import setup_device

    with pytest.raises(ValueError, match="cannot run next to a live CUDA runtime"):
        setup_device("cpu")
    assert cli.run(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mcore")]) == 0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # hidden at the entry, before megatron-core's imports
    assert cli.run(["convert", "mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "config.json").is_file()


def test_eval_exports_a_training_checkpoint_in_a_child_without_the_gpu(tmp_path: Path, monkeypatch):
    """eval keeps the GPU for its engine; the export runs in `megatron-dapo convert` with none."""
    from megatron_dapo import convert, evaluate

    hf = make_tiny_checkpoint(tmp_path / "hf", "qwen2", num_layers=2, seed=2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cli.run(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mcore")]) == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # this process: a GPU node's

    def in_process(*args, **kwargs):
        raise AssertionError("exported in the process that holds the GPU")

    monkeypatch.setattr(convert, "mcore_to_hf", in_process)
    out = evaluate.export_to_hf(tmp_path / "mcore", tmp_path / "exported")
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # this process still sees its GPU
    with pytest.raises(Exception, match="exists and is not empty"):
        evaluate.export_to_hf(tmp_path / "mcore", tmp_path / "exported")
