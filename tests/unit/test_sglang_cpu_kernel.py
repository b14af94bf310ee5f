"""SGLang on any x86-64 CPU: the sgl_kernel stand-in, the install's choice, the pre-run probe.

docs/DESIGN.md, "SGLang's CPU kernels". The stand-in is loaded here by path (it is installed into
the SGLang venv, never imported by megatron-dapo); the install script is run with a cpuinfo of
another CPU; the probe is run on interpreters that are wrong in each way a user has met.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo import cli
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.server_process import ServerProcess, describe_exit
from megatron_dapo.rollout.sglang.interpreter import check_interpreter
from megatron_dapo.train import one_line

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "scripts" / "sglang_cpu" / "site" / "sgl_kernel" / "__init__.py"
INSTALL = REPO / "scripts" / "install_sglang_cpu.sh"
ZEN3_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2"
ZEN4_FLAGS = ZEN3_FLAGS + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni"


@pytest.fixture(scope="module")
def standin():
    spec = importlib.util.spec_from_file_location("_sgl_kernel_standin", STANDIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_standin_registers_no_op_and_names_the_way_out_of_what_it_lacks(standin):
    """No torch.ops.sgl_kernel op: SGLang's cpu_has_amx_support() asks for convert_weight_packed."""
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
    assert standin.MEGATRON_DAPO_STANDIN is True
    with pytest.raises(RuntimeError, match=r"verify_tree_greedy_cpu was called.*SGLANG_CPU_KERNEL_WHEEL=<wheel>"):
        standin.verify_tree_greedy_cpu(None)
    # Probes that SGLang wraps in try/except must fail, so they take their fallbacks.
    with pytest.raises(AttributeError):
        standin.fast_topk  # noqa: B018


def test_the_standin_traces_its_calls_when_asked(standin, tmp_path, monkeypatch):
    trace = tmp_path / "calls.txt"
    monkeypatch.setenv("MEGATRON_DAPO_SGL_KERNEL_TRACE", str(trace))
    with pytest.raises(RuntimeError):
        standin.assign_req_to_token_pool_cpu(None, None, None, None, None, 4)
    assert trace.read_text() == "assign_req_to_token_pool_cpu\n"


def _install(tmp_path: Path, flags: str, **env: str) -> subprocess.CompletedProcess:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"model name\t: test\nflags\t\t: {flags}\n")
    full = {**os.environ, "MEGATRON_DAPO_CPUINFO": str(cpuinfo),
            "MEGATRON_DAPO_SGLANG_VENV": str(tmp_path / "venv"), **env}
    return subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, env=full, timeout=60)


def test_the_install_refuses_a_kernel_build_this_cpu_cannot_execute(tmp_path):
    """A real kernel build on an AVX2-only CPU died with SIGILL at import: refused before anything is
    installed, naming the missing instruction sets and the default that works."""
    wheel = tmp_path / "sglang_kernel_cpu-0.4.6.post1-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"not really")
    done = _install(tmp_path, ZEN3_FLAGS, SGLANG_CPU_KERNEL_WHEEL=str(wheel))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1
    assert "this CPU lacks: avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 avx512_vnni" in done.stderr
    assert "unset SGLANG_CPU_KERNEL_WHEEL" in done.stderr
    assert not (tmp_path / "venv").exists()
    missing = _install(tmp_path, ZEN4_FLAGS, SGLANG_CPU_KERNEL_WHEEL=str(tmp_path / "nope.whl"))
    assert missing.returncode == 2 and "is not a file" in missing.stderr


def test_the_install_needs_no_file_outside_the_repository():
    """Nothing the install reads lies beside the repository (../shared is the developers', not the users')."""
    text = INSTALL.read_text()
    assert "../shared" not in text and "shared/" not in text
    assert (REPO / "scripts/sglang_cpu/site/_megatron_dapo_torchvision_ops.pth").exists()


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(body)
    path.chmod(0o755)
    return str(path)


def test_the_probe_names_what_is_wrong_with_the_sglang_interpreter(tmp_path):
    python_without_sglang = _script(tmp_path, "python-plain", f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    cases = {
        str(tmp_path): "is a directory, not an interpreter",
        "/bin/false": "did not run as a Python (exited with code 1",
        _script(tmp_path, "notes.txt", "just some text\n"): "cannot be run",
        _script(tmp_path, "not-python", "#!/bin/sh\necho hello\n"): "did not run as a Python (exited with code 0",
        python_without_sglang: "is a Python without sglang",
        _script(tmp_path, "sigill", "#!/bin/sh\nkill -ILL $$\n"):
            "was killed by SIGILL (illegal instruction: its native code uses an instruction this CPU lacks",
    }
    if importlib.util.find_spec("sglang") is not None:
        del cases[python_without_sglang]
    for python, expected in cases.items():
        with pytest.raises(UserError) as err:
            check_interpreter(python, "rollout.sglang.python")
        assert expected in str(err.value), (python, str(err.value))
        assert "\n" not in str(err.value)


def test_config_validate_refuses_an_sglang_python_that_cannot_serve(tmp_path, capsys):
    """`config validate` asks the interpreter what `train` would need of it, before any work."""
    sigill = _script(tmp_path, "sigill", "#!/bin/sh\nkill -ILL $$\n")
    for python, expected in (("/bin/false", "did not run as a Python"), (sigill, "was killed by SIGILL")):
        code = cli.run(["config", "validate", str(REPO / "examples/tiny_cpu.yaml"), "rollout.engine=sglang",
                        f"rollout.sglang.python={python}"])
        err = capsys.readouterr().err.strip()
        assert code == 2, err
        assert len(err.splitlines()) == 1 and expected in err and "Traceback" not in err


def test_an_engine_killed_at_start_is_named_by_its_signal(tmp_path):
    """What a SIGILL server looked like in the trainer: "exited with code -4" and a traceback. Now
    the signal by name and what it means, and the train entry point prints the first line."""
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGILL).startswith("was killed by SIGILL (illegal instruction: ")
    assert describe_exit(-signal.SIGKILL).startswith("was killed by SIGKILL (killed: from outside")
    process = ServerProcess(["/bin/sh", "-c", "echo loading; kill -ILL $$"], name="sglang0",
                            log_path=tmp_path / "sglang0.log")
    assert process.wait_for_exit(30) == -signal.SIGILL
    with pytest.raises(RuntimeError) as err:
        process.check_alive()
    line = one_line(err.value)
    assert line.startswith(f"SGLang engine sglang0 (pid {process.pid}) was killed by SIGILL (illegal instruction")
    assert line.endswith(f"; log {tmp_path / 'sglang0.log'}")


def test_a_directory_named_after_an_engine_is_not_the_engine(tmp_path, monkeypatch):
    """2026-11-27: a run whose output_dir was ./sglang, trained from that working directory, launched
    its server with this Python ("No module named sglang.launch_server"): find_spec found the
    directory as a namespace package. The same held for ./vllm."""
    from megatron_dapo.rollout.server_process import package_installed
    from megatron_dapo.rollout.sglang.interpreter import sglang_python

    (tmp_path / "sglang").mkdir()
    (tmp_path / "vllm").mkdir()
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MEGATRON_DAPO_SGLANG_VENV", str(venv))
    assert importlib.util.find_spec("sglang") is not None  # the trap: a namespace package
    assert not package_installed("sglang")
    assert sglang_python() == str(venv / "bin" / "python")
    assert package_installed("vllm") == (importlib.util.find_spec("vllm").origin is not None)
    assert package_installed("json") and not package_installed("no_such_package_42")
