"""HF -> Megatron (2 processes under torchrun) -> HF through the two tools is bit-exact, and bad
checkpoints fail with one line and exit code 2.

Qwen2 (untied, qkv bias) is written at TP=2, Llama (tied embeddings, 3 layers: uneven stages) at PP=2; both are
exported by one process (TP=1), so the export also reshards, and vocab_size=100 makes the
TP=2 checkpoint's padded vocab (256 rows) differ from TP=1's default (128).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TO_MCORE = ROOT / "tools" / "convert_hf_to_mcore.py"
TO_HF = ROOT / "tools" / "convert_mcore_to_hf.py"
TOKENIZER_FILES = {"tokenizer_config.json": '{"model_max_length": 128}\n', "special_tokens_map.json": "{}\n"}


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(args: list[str], nproc: int = 1) -> subprocess.CompletedProcess[str]:
    from megatron_dapo.launcher import free_port

    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
            *args,
        ]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def _hf(root: Path, family: str, tied: bool, num_layers: int = 2) -> Path:
    path = make_tiny_checkpoint(root / f"{family}_hf", family, num_layers=num_layers, tie_word_embeddings=tied, seed=3)
    for name, text in TOKENIZER_FILES.items():
        (path / name).write_text(text)
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """{family: (hf_dir, mcore_dir)} converted by the tool with two processes."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    # Llama has 3 layers: PP=2 writes uneven stages, 2 + 1 (megatron_dapo/plan/stages.py).
    for family, tied, layout, layers in (("qwen2", False, ["--tp", "2"], 2), ("llama", True, ["--pp", "2"], 3)):
        hf = _hf(root, family, tied, layers)
        mcore = root / f"{family}_mcore"
        proc = _run([str(TO_MCORE), "--hf", str(hf), "--out", str(mcore), *layout], nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[family] = (hf, mcore)
    return out


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_hf_to_mcore_to_hf_is_bit_exact(
    converted: dict[str, tuple[Path, Path]], tmp_path: Path, family: str
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf, mcore = converted[family]
    manifest = json.loads((mcore / "manifest.json").read_text())
    assert manifest["model_family"] == family and manifest["has_optimizer"] is False
    assert manifest["model"]["vocab_size"] == (256 if family == "qwen2" else 128)

    out = tmp_path / "hf_out"
    proc = _run([str(TO_HF), "--ckpt", str(mcore), "--out", str(out), "--max-shard-size", "60KB"])
    assert proc.returncode == 0, proc.stderr[-3000:]

    original = load_file(str(hf / "model.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(index["weight_map"]) == sorted(original)
    exported: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(str(shard))
        assert all(index["weight_map"][name] == shard.name for name in part)
        exported.update(part)
    assert sorted(exported) == sorted(original)
    assert [name for name in original if not torch.equal(original[name], exported[name])] == []
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    for name, text in TOKENIZER_FILES.items():
        assert (out / name).read_text() == text
    assert json.loads((out / "config.json").read_text()) == json.loads((hf / "config.json").read_text())

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    state = model.state_dict()
    assert [n for n, t in original.items() if not torch.equal(state[n], t)] == []


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("convert_mcore_to_hf: error: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_truncated_shard_is_one_line_exit_2(converted: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(converted["qwen2"][1], broken)
    shard = max((broken / "dist").glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    line = _one_line_error(_run([str(TO_HF), "--ckpt", str(broken), "--out", str(tmp_path / "o")]))
    assert f"shard {shard} is truncated ({size // 2} of " in line
    assert not (tmp_path / "o").exists()


def test_flipped_byte_in_tensor_data_is_one_line_exit_2(converted: dict[str, tuple[Path, Path]],
                                                      tmp_path: Path) -> None:
    # Before: the export succeeded with one weight silently changed.
    broken = tmp_path / "broken"
    shutil.copytree(converted["qwen2"][1], broken)
    shard = max((broken / "dist").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    line = _one_line_error(_run([str(TO_HF), "--ckpt", str(broken), "--out", str(tmp_path / "o")]))
    assert (f"checkpoint {broken}: dist/{shard.name} does not match its checksum (corrupted on disk or in a "
            "copy); use an earlier checkpoint or copy this one again") in line
    assert not (tmp_path / "o").exists()


def test_truncated_metadata_is_one_line_exit_2(
    converted: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(converted["qwen2"][1], broken)
    meta = broken / "dist" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    line = _one_line_error(_run([str(TO_HF), "--ckpt", str(broken), "--out", str(tmp_path / "o")]))
    assert f"{meta} is truncated or corrupted" in line


def test_no_checkpoint_and_wrong_family_and_wrong_shape(
    converted: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    qwen_hf, qwen_mcore = converted["qwen2"]
    line = _one_line_error(_run([str(TO_HF), "--ckpt", str(tmp_path), "--out", str(tmp_path / "o")]))
    assert line == (
        f"convert_mcore_to_hf: error: no checkpoint at {tmp_path}: manifest.json is missing; pass a step_<N> "
        "directory written by megatron-dapo (or a checkpoints root with a 'latest' file)"
    )

    llama_hf = converted["llama"][0]
    line = _one_line_error(
        _run(
            [
                str(TO_HF),
                "--ckpt",
                str(qwen_mcore),
                "--out",
                str(tmp_path / "o"),
                "--hf-config-from",
                str(llama_hf),
            ]
        )
    )
    assert f"holds a 'qwen2' model but {llama_hf / 'config.json'} describes a 'llama' model" in line

    wider = tmp_path / "wider"
    shutil.copytree(qwen_hf, wider)
    cfg = json.loads((wider / "config.json").read_text())
    cfg.update(hidden_size=128, num_hidden_layers=4)
    (wider / "config.json").write_text(json.dumps(cfg))
    line = _one_line_error(
        _run(
            [
                str(TO_HF),
                "--ckpt",
                str(qwen_mcore),
                "--out",
                str(tmp_path / "o"),
                "--hf-config-from",
                str(wider),
            ]
        )
    )
    assert "does not match the model: num_layers=2 (model: 4), hidden_size=64 (model: 128)" in line
