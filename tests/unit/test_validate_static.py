"""`config validate --static`: what a login node can check of a GPU recipe (issue 60).

No device, Transformer Engine or engine probe; a path missing here is a warning, a `/path/to/`
placeholder is named as one; everything else (keys, values, the layout at the world size, the
reward module) still fails in one line with exit 2. The sbatch scripts' DRY_RUN runs it first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo import cli

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# The world sizes the recipes document (their trainer.nnodes x n_gpus_per_node, the sbatch scripts').
WORLD_SIZES = {"dapo_qwen2.5_32b.yaml": 128, "dapo_qwen2.5_32b_lora.yaml": 8, "dapo_qwen3_30b_a3b.yaml": 32, "dapo_qwen2.5_7b.yaml": 8}


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_every_example_passes_static_validation_here(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["config", "validate", "--static", str(example)]
    if example.name in WORLD_SIZES:
        argv += ["--world-size", str(WORLD_SIZES[example.name])]
    code = cli.run(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith(f"{example}: OK (--static: ")
    if example.name in WORLD_SIZES:
        assert f"at world size {WORLD_SIZES[example.name]})" in out
        # The recipes' checkpoint and prompt files are /path/to/ placeholders: named, not fatal.
        assert "warning: model.hf_checkpoint='/path/to/" in err and "is a placeholder" in err


def test_static_validation_takes_the_recipes_own_world_size(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.run(["config", "validate", "--static", str(REPO / "examples/dapo_qwen2.5_32b.yaml")])
    assert code == 0
    assert "(data-parallel size 8 at world size 128)" in capsys.readouterr().out
    code = cli.run(["config", "validate", "--static", str(REPO / "examples/dapo_qwen2.5_32b.yaml"),
                    "--world-size", "120"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [err] and "started 120 processes (--world-size)" in err


def test_without_static_a_gpu_recipe_still_needs_its_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """What --static leaves out is still checked by a plain validate (and by train)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    code = cli.run(["config", "validate", str(REPO / "examples/dapo_qwen2.5_32b.yaml")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "sees no CUDA GPU" in err


@pytest.mark.parametrize("override, fragment", [
    ("trainer.sav_interval=3", "did you mean 'trainer.save_interval'?"),
    ("reward.reward_fn=no_such_module:f", "module 'no_such_module' not found"),
    ("parallel.tensor_model_parallel_size=3", "does not divide"),
])
def test_static_validation_still_fails_in_one_line(override: str, fragment: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.run(["config", "validate", "--static", str(REPO / "examples/dapo_qwen2.5_32b.yaml"), override])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.splitlines() == [err] and fragment in err


def test_a_missing_path_is_a_warning_only_under_static(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "not_mounted_here" / "Qwen2.5-7B"
    argv = ["config", "validate", str(REPO / "examples/tiny_cpu.yaml"), f"model.hf_checkpoint={missing}",
            f"data.train_files=[{tmp_path}/lustre/train.parquet]"]
    assert cli.run([*argv[:2], "--static", *argv[2:]]) == 0
    err = capsys.readouterr().err
    assert f"warning: model.hf_checkpoint='{missing}' does not exist on this machine" in err
    assert f"warning: data.train_files[0]='{tmp_path}/lustre/train.parquet' does not exist on this machine" in err
    assert cli.run(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "is not a directory" in err


def test_a_placeholder_is_named_as_one_without_static(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.run(["config", "validate", str(REPO / "examples/tiny_cpu.yaml"),
                    "model.hf_checkpoint=/path/to/Qwen2.5-7B"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("error: model.hf_checkpoint='/path/to/Qwen2.5-7B' is a placeholder: replace it "
                                 "with the path of your HF checkpoint directory")


def test_static_validation_imports_the_reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "rw_static_broken.py").write_text("import no_such_dependency_here\n"
                                                  "def f(s, gt, extra_info=None):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    code = cli.run(["config", "validate", "--static", str(REPO / "examples/dapo_qwen2.5_32b.yaml"),
                    "reward.reward_fn=rw_static_broken:f"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert [line for line in err if not line.startswith("warning:")] == [err[-1]]
    assert "no_such_dependency_here" in err[-1]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "MASTER_"))}
    return {**env, "PYTHON": sys.executable, **extra}


@pytest.mark.parametrize("script", ["dapo_32b.sbatch", "dapo_qwen3_30b_a3b.sbatch", "dapo_tiny.sbatch"])
def test_dry_run_validates_before_it_plans(script: str) -> None:
    proc = subprocess.run(["bash", f"slurm/{script}", "reward.reward_fn=no_such_module:f"],
                          env=_clean_env(DRY_RUN="1"), text=True, capture_output=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""  # no plan, no layout
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("warning:")]
    assert lines == ["error: reward function 'no_such_module:f': module 'no_such_module' not found; expected a "
                     "built-in name (math_dapo) or 'package.module:function' with the module importable from "
                     "PYTHONPATH"]


@pytest.mark.parametrize("static", [False, True], ids=["full", "static"])
def test_the_custom_reward_example_validates(static: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Its verl-style module imports (probed in a worker) and its prompt files are read with the
    embedded task's tokenizer, as train reads them."""
    monkeypatch.setenv("MEGATRON_DAPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(REPO)
    example = "examples/custom_reward/custom_reward.yaml"
    code = cli.run(["config", "validate", *(["--static"] if static else []), example,
                    "data.embedded.num_train=200", "data.embedded.num_val=8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith(f"{example}: OK") and "warning" not in err
    code = cli.run(["config", "validate", example, "data.embedded.num_train=200", "data.embedded.num_val=8",
                    "data.train_batch_size=65", "data.gen_batch_size=65", "trainer.ppo_mini_batch_size=13"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "holds 64 usable prompt(s), fewer than data.train_batch_size=65" in err


def test_a_checkpoint_not_here_of_an_unknown_model_leaves_only_its_shape_unchecked(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["config", "validate", "--static", str(REPO / "examples/dapo_qwen2.5_32b.yaml"),
            "model.hf_checkpoint=/lustre/models/my-model"]
    assert cli.run(argv) == 0
    err = capsys.readouterr().err
    assert "warning: model.hf_checkpoint='/lustre/models/my-model' does not exist on this machine" in err
    assert "the layout is not checked against the model's shape here (--static)" in err
    # The world size is still checked.
    assert cli.run([*argv, "trainer.n_gpus_per_node=null", "--world-size", "100"]) == 2
    assert "does not divide the world size 100" in capsys.readouterr().err
