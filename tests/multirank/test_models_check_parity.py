"""tools/check_parity.py under torchrun at TP=2 and PP=2, and for Qwen3-MoE at EP=2, TP2 x EP2 and PP2 x EP2
(issue 25), and its exit codes. The PP=2 cases use 3-layer models: uneven stages, 2 + 1 (issue 39)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_parity.py"
RESULT = re.compile(r"(PASS|FAIL) tp=(\d) pp=(\d) ep=\d sp=(\d) .* max \|delta log p\(next token\)\| = (\S+) ")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parity_tool")
    return {
        "qwen2": make_tiny_checkpoint(root / "qwen2", "qwen2", seed=3),
        # 3 layers: PP=2 splits them 2 + 1 (megatron_dapo/plan/stages.py).
        "llama_tied": make_tiny_checkpoint(root / "llama", "llama", num_layers=3, tie_word_embeddings=True, seed=4),
        "qwen3_moe": make_tiny_checkpoint(root / "qwen3_moe", "qwen3_moe", seed=5),
        "qwen3_moe_3": make_tiny_checkpoint(root / "qwen3_moe_3", "qwen3_moe", num_layers=3, seed=6),
    }


def _run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env=env)


@pytest.mark.parametrize(("family", "tp", "pp", "sp"),
                         [("qwen2", 2, 1, False), ("llama_tied", 1, 2, False), ("qwen2", 2, 1, True)])
def test_torchrun_two_ranks_pass(tiny: dict[str, Path], family: str, tp: int, pp: int, sp: bool) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    proc = _run(
        [
            *torchrun,
            str(TOOL),
            "--hf-checkpoint",
            str(tiny[family]),
            "--tp",
            str(tp),
            "--pp",
            str(pp),
            "--num-tokens",
            "16",
            *(["--sequence-parallel"] if sp else []),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = RESULT.search(proc.stdout)
    assert match is not None, proc.stdout
    assert match.group(1, 2, 3, 4) == ("PASS", str(tp), str(pp), str(int(sp)))
    assert float(match.group(5)) < 1e-4


@pytest.mark.parametrize(("nproc", "tp", "pp", "ep"), [(2, 1, 1, 2), (4, 2, 1, 2), (4, 1, 2, 2)],
                         ids=["ep2", "tp2xep2", "pp2xep2"])
def test_torchrun_moe_expert_parallel_pass(tiny: dict[str, Path], nproc: int, tp: int, pp: int, ep: int) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    model = tiny["qwen3_moe_3" if pp > 1 else "qwen3_moe"]  # uneven stages at PP=2
    proc = _run([*torchrun, str(TOOL), "--hf-checkpoint", str(model), "--tp", str(tp), "--pp", str(pp),
                 "--ep", str(ep), "--num-tokens", "16"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"PASS tp=(\d) pp=(\d) ep=(\d) .* = (\S+) ", proc.stdout)
    assert match is not None, proc.stdout
    assert match.group(1, 2, 3) == (str(tp), str(pp), str(ep))
    assert float(match.group(4)) < 1e-4


def test_missing_expert_tensor_is_named_in_one_line(tiny: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken_moe"
    shutil.copytree(tiny["qwen3_moe"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    # A process of its own: the tool joins a one-process world first, which in pytest's process
    # left RANK/WORLD_SIZE/MASTER_PORT in os.environ and a store on that port, so every later
    # trainer subprocess took itself for a launched rank and failed with EADDRINUSE.
    proc = _run([sys.executable, str(TOOL), "--hf-checkpoint", str(broken), "--num-tokens", "8"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "missing" in line]
    assert len(lines) == 1 and "1 missing: model.layers.2.mlp.experts.3.up_proj.weight" in lines[0], proc.stderr


def test_difference_above_tolerance_exits_1(tiny: dict[str, Path]) -> None:
    # bf16 rounding differs between the two implementations by ~1e-3 in log p, far above 1e-6.
    command = [sys.executable, str(TOOL), "--hf-checkpoint", str(tiny["qwen2"]), "--num-tokens", "8"]
    # A stale MASTER_ADDR from the shell must not capture a one-process run's rendezvous.
    env = {**os.environ, "MASTER_ADDR": "unreachable.invalid", "MASTER_PORT": "1"}
    proc = _run([*command, "--dtype", "bf16", "--tolerance", "1e-6"], env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    match = RESULT.search(proc.stdout)
    assert match is not None and match.group(1) == "FAIL"
    assert 1e-6 < float(match.group(5)) < 0.1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tp", "3"], "world size 1 is not divisible by tp*pp*cp = 3*1*1 = 3"),
        (["--tolerance", "-1"], "--tolerance -1.0 is negative"),
        (["--ep", "2"], "world size 1 is not divisible by ep*etp*pp"),
        (["--tp", "2", "--sequence-parallel", "--num-tokens", "7"], "--sequence-parallel needs --tp > 1 and --num-tokens a multiple"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    tiny: dict[str, Path], extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process: bad input is rejected before any process group or CPU layer exists.
    sys.path.insert(0, str(TOOL.parent))
    try:
        import check_parity
    finally:
        sys.path.remove(str(TOOL.parent))
    assert check_parity.main(["--hf-checkpoint", str(tiny["qwen2"]), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("check_parity: error: ") and message in err


def test_missing_checkpoint_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(TOOL.parent))
    try:
        import check_parity
    finally:
        sys.path.remove(str(TOOL.parent))
    assert check_parity.main(["--hf-checkpoint", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"check_parity: error: HF checkpoint {tmp_path / 'nope'} has no config.json; pass the directory save_pretrained wrote\n"
    )
