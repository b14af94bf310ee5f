"""constraints/gpu.txt against setup.py's ranges, offline (the network half is
scripts/check_gpu_pins.py, which .ci/run runs)."""

import importlib.util
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_gpu_pins", ROOT / "scripts" / "check_gpu_pins.py")
pins_mod = importlib.util.module_from_spec(_spec)
sys.modules["check_gpu_pins"] = pins_mod  # dataclasses look their module up there
_spec.loader.exec_module(pins_mod)

PINS = pins_mod.read_pins(ROOT / "constraints" / "gpu.txt")
ENV = pins_mod.target_env("3.12")


def test_setup_ranges_admit_every_pin():
    reqs = pins_mod.setup_requirements(ROOT / "setup.py", "gpu")
    assert pins_mod.conflicts("setup.py", reqs, PINS, ENV) == []
    # Each package of the gpu extra and the torch/megatron-core ranges is actually pinned,
    # so the check above compared something.
    names = {r.name for r in reqs}
    assert {"torch", "megatron-core", "transformer-engine", "sglang"} <= names
    assert {"torch", "megatron-core", "transformer-engine", "sglang"} <= set(PINS)


def test_setup_keeps_the_cpu_torch_and_refuses_old_te():
    reqs = {r.name: r for r in pins_mod.setup_requirements(ROOT / "setup.py", "gpu")}
    assert reqs["torch"].specifier.contains("2.13.0")  # the CPU wheel of make test
    assert reqs["torch"].specifier.contains(PINS["torch"].version)
    assert not reqs["transformer-engine"].specifier.contains("2.7.0")  # zero-gradient TE
    assert reqs["transformer-engine"].specifier.contains("2.8.0")
    # 0.5.3 is the first with --config, through which the server gets its key (not the command line).
    assert not reqs["sglang"].specifier.contains("0.5.2")
    assert reqs["sglang"].specifier.contains("0.5.3") and reqs["sglang"].specifier.contains("0.5.23")
    assert not reqs["sglang"].specifier.contains("0.6.0")


def test_te_pins_agree_and_are_not_below_the_floor():
    te = {n: p.version for n, p in PINS.items() if n.startswith("transformer-engine")}
    assert set(te) == {"transformer-engine", "transformer-engine-torch", "transformer-engine-cu13"}
    assert len(set(te.values())) == 1 and te["transformer-engine"] >= Version("2.8")


def test_conflict_is_one_line_naming_both_sides():
    requires = [Requirement("torch==2.14.1"), Requirement("triton~=3.8.0; platform_system == 'Linux'")]
    pins = {
        "torch": pins_mod.Pin(name="torch", version=Version("2.13.0")),
        "triton": pins_mod.Pin(name="triton", version=Version("3.8.0")),
    }
    assert pins_mod.conflicts("sglang==0.5.23", requires, pins, ENV) == [
        "sglang==0.5.23 requires torch==2.14.1 but the constraints pin torch==2.13.0"
    ]


def test_markers_and_extras_decide_what_applies():
    pins = {"transformer-engine-cu12": pins_mod.Pin(name="transformer-engine-cu12", version=Version("2.7.0"))}
    req = [Requirement('transformer_engine_cu12==2.11.0; extra == "core"')]
    assert pins_mod.conflicts("te", req, pins, ENV) == []
    assert len(pins_mod.conflicts("te", req, pins, ENV, frozenset({"core"}))) == 1
    win = [Requirement("transformer_engine_cu12==2.11.0; sys_platform == 'win32'")]
    assert pins_mod.conflicts("te", win, pins, ENV) == []


@pytest.mark.parametrize(
    ("filename", "python", "fits"),
    [
        ("sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl", "3.12", True),
        ("sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl", "3.11", False),
        ("sglang-0.5.23-cp312-cp312-manylinux_2_34_aarch64.whl", "3.12", False),
        ("sglang_kernel-0.4.10-cp310-abi3-manylinux2014_x86_64.whl", "3.12", True),
        ("x-1.0-cp312-cp312-manylinux_2_39_x86_64.whl", "3.12", False),  # newer glibc than the target
        ("transformers-5.19.0-py3-none-any.whl", "3.11", True),
    ],
)
def test_wheel_tags_for_the_target(filename, python, fits):
    assert pins_mod._wheel_fits(filename, python) is fits


def test_only_exact_pins(tmp_path):
    bad = tmp_path / "c.txt"
    bad.write_text("torch>=2.14\n")
    with pytest.raises(SystemExit, match=r"c.txt:1: 'torch>=2.14' is not an exact pin"):
        pins_mod.read_pins(bad)


def test_docker_base_image_carries_the_pinned_torch():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    base = next(ln.split("=", 1)[1] for ln in dockerfile.splitlines() if ln.startswith("ARG BASE_IMAGE="))
    # pytorch/pytorch:<torch>-cuda<X>-cudnn<Y>-devel: pip must find the pinned torch already there.
    assert base.startswith(f"pytorch/pytorch:{PINS['torch'].version}-cuda13.")
    assert base.endswith("-devel")  # nvcc, for transformer_engine_torch's sdist
    assert "-c constraints/gpu.txt" in dockerfile and '".[gpu' in dockerfile


def _meta(name, version, *requires, sdist=False):
    text = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    text += "".join(f"Requires-Dist: {r}\n" for r in requires)
    return text, f"{name}-{version}" + (".tar.gz" if sdist else "-py3-none-any.whl")


def test_resolver_gets_an_sdist_only_pin_as_its_requirements():
    metas = {
        "transformer-engine": _meta(
            "transformer-engine", "2.11.0",
            'transformer_engine_torch==2.11.0; extra == "pytorch"',
            'transformer_engine_cu13==2.11.0; extra == "core-cu13"',
        ),
        "transformer-engine-torch": _meta(
            "transformer_engine_torch", "2.11.0", "torch>=2.1", "onnx", "transformer_engine_cu12==2.11.0", sdist=True
        ),
        "transformer-engine-cu13": _meta("transformer_engine_cu13", "2.11.0"),
        "sglang": _meta("sglang", "0.5.23", "torch==2.14.1"),
    }  # fmt: skip
    reqs = pins_mod.resolve_requirements(metas, "3.12")
    assert "transformer-engine>=2.8" in reqs  # the [pytorch] extra (the sdist) is dropped
    assert "sglang[srt]<0.6,>=0.5.3" in reqs
    # the sdist's requirements instead, its TE core swapped for the CUDA 13 one the constraints pin
    assert reqs[-3:] == ["torch>=2.1", "onnx", "transformer-engine-cu13==2.11.0"]
