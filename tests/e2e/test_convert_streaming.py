"""One process converts for any layout (--tp/--pp/--ep) by streaming, within its memory bound, bit-exactly.

Issue 28: the README's `convert_hf_to_mcore.py ... --tp 8 --pp 2` stopped with "needs 16
processes", and the one-process conversion held 2.4x the checkpoint. Here one process
writes the layout's checkpoint (vocab padded for its TP) a tensor at a time, torchrun
loads and exports it in that layout, and the reverse; Qwen3-MoE round-trips through
expert parallelism (the leftover of issue 25). The memory bound is measured on a
shaped checkpoint of 170 MB (tools/make_shaped_checkpoint.py, Qwen2.5-32B's config with
a shrunk width); benchmarks/scale.py measures the 4.7 GiB one.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_utils import make_tiny_checkpoint
from test_convert_roundtrip import ROOT, TO_HF, TO_MCORE, _env, _run

from megatron_dapo.models.hf_checkpoint import HFCheckpoint

pytestmark = pytest.mark.e2e

SHAPED = ROOT / "tools" / "make_shaped_checkpoint.py"
_PEAK = re.compile(r"peak RSS (\d+\.\d+) GiB for a (\d+\.\d+) GiB checkpoint")


def _ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _peak_gib(proc: subprocess.CompletedProcess[str]) -> float:
    match = _PEAK.search(proc.stdout)
    assert match, proc.stdout
    return float(match.group(1))


def _differing(a: Path, b: Path) -> list[str]:
    """The tensors of HF checkpoint a that differ from b's, bit for bit (names, shapes and dtypes must match)."""
    ca, cb = HFCheckpoint(a, mapped=False), HFCheckpoint(b, mapped=False)
    assert ca.shapes == cb.shapes and ca.dtypes == cb.dtypes
    return [n for n in ca.shapes if not torch.equal(ca.read(n), cb.read(n))]


def test_one_process_writes_any_layout_and_torchrun_exports_it(tmp_path: Path) -> None:
    hf = make_tiny_checkpoint(tmp_path / "hf", "qwen2", num_layers=2, seed=5)
    mcore = tmp_path / "mcore"
    # The README's line, in one process: TP and PP are accepted, the vocab padded for TP=2.
    proc = _ok(_run([str(TO_MCORE), "--hf", str(hf), "--out", str(mcore), "--tp", "2", "--pp", "2"]))
    assert "(tp=2 pp=2 ep=1; loads at any layout)" in proc.stdout
    assert json.loads((mcore / "manifest.json").read_text())["model"]["vocab_size"] == 256
    out = tmp_path / "out"
    _ok(_run([str(TO_HF), "--ckpt", str(mcore), "--out", str(out), "--tp", "2"], nproc=2))
    assert _differing(hf, out) == []


@pytest.mark.parametrize("writer_procs", [2, 1], ids=["torchrun_ep2_then_one_process", "one_process_then_torchrun_ep2"])
def test_qwen3_moe_round_trips_through_expert_parallelism(tmp_path: Path, writer_procs: int) -> None:
    hf = make_tiny_checkpoint(tmp_path / "hf", "qwen3_moe", num_layers=2, seed=6, moe={}, dtype=torch.bfloat16)
    mcore, out = tmp_path / "mcore", tmp_path / "out"
    _ok(_run([str(TO_MCORE), "--hf", str(hf), "--out", str(mcore), "--ep", "2"], nproc=writer_procs))
    _ok(_run([str(TO_HF), "--ckpt", str(mcore), "--out", str(out), "--ep", "2"], nproc=3 - writer_procs))
    assert any(".mlp.experts." in name for name in HFCheckpoint(out, mapped=False).shapes)
    assert _differing(hf, out) == []


def test_bad_layouts_are_one_line_exit_2(tmp_path: Path) -> None:
    hf = make_tiny_checkpoint(tmp_path / "hf", "qwen2", num_layers=2, seed=5)
    for flags, expected in (
        (["--ep", "2"], "--ep 2 needs a mixture-of-experts model, but Qwen2ForCausalLM has no experts; drop --ep"),
        (["--tp", "3"], "--tp 3 --pp 1 --ep 1: num_attention_heads=4 is not divisible by tp=3; pick tp among "
                        "the divisors of 4"),
    ):
        proc = _run([str(TO_MCORE), "--hf", str(hf), "--out", str(tmp_path / "o"), *flags])
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == f"convert_hf_to_mcore: error: {expected}"
        assert not (tmp_path / "o").exists()


def test_shaped_checkpoint_converts_within_the_memory_bound(tmp_path: Path) -> None:
    """Qwen2.5-32B's config (qkv bias, 8 KV heads, untied) at hidden 512 and vocab 32000: 4 layers, 3 shards.

    The shrunk vocab keeps the layers most of the checkpoint (60%), so a converter that
    held the model would exceed the bound; the flagship's 152,064 rows are benchmarks/scale.py's.
    """
    tiny = make_tiny_checkpoint(tmp_path / "tiny", "qwen2", num_layers=2, seed=5)
    baseline = _peak_gib(_ok(_run([str(TO_MCORE), "--hf", str(tiny), "--out", str(tmp_path / "tiny_mc")])))

    hf = tmp_path / "shaped"
    cmd = [sys.executable, str(SHAPED), "--model", "Qwen2.5-32B", "--layers", "4", "--out", str(hf),
           "--max-shard-size", "64MB", "--set", "hidden_size=512", "--set", "intermediate_size=8192",
           "--set", "vocab_size=32000"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((hf / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"], config["num_key_value_heads"]) == (4, 32000, 8)
    shards = sorted(hf.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in shards) / 2**30
    assert len(shards) == 3 and all(f.stat().st_size <= 64e6 for f in shards)
    assert HFCheckpoint(hf).dtypes["model.layers.3.self_attn.k_proj.bias"] == "BF16"

    mcore, out = tmp_path / "mcore", tmp_path / "out"
    to_mcore = _ok(_run([str(TO_MCORE), "--hf", str(hf), "--out", str(mcore), "--tp", "8", "--pp", "2"]))
    to_hf = _ok(_run([str(TO_HF), "--ckpt", str(mcore), "--out", str(out), "--max-shard-size", "64MB"]))
    assert _differing(hf, out) == []
    assert json.loads((mcore / "manifest.json").read_text())["model"]["vocab_size"] == 32768  # 1024 * 32
    # The bound of issue 28 is 0.75x the checkpoint + 1.5 GiB; the 1.5 GiB is more than this
    # process' imports (baseline), so hold what the conversion itself adds to 0.75x.
    for proc in (to_mcore, to_hf):
        assert _peak_gib(proc) - baseline <= 0.75 * size, (proc.stdout, baseline, size)
