"""The `slurm_cluster` session fixture: a real one-node SLURM cluster (see slurm_testbed.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import slurm_jobs
from slurm_testbed import SlurmCluster, start_cluster, stop_cluster
from tiers import unavailable


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """munged + slurmctld + slurmd on 127.0.0.1 for this session, stopped after it."""
    if os.geteuid() != 0:
        unavailable("the SLURM test cluster runs its daemons as root (SlurmUser=root); run pytest as root")
    cluster, procs = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        stop_cluster(procs)


@pytest.fixture(scope="module")
def trainer_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for trainer jobs: the test reward importable, caches (tokenizer) in one tmp dir."""
    if (reason := slurm_jobs.trainer_missing()) is not None:
        unavailable(reason)
    return {"PYTHON": sys.executable, "PYTHONPATH": f"{slurm_jobs.PROBE_DIR}:{slurm_jobs.REPO}",
            "MEGATRON_DAPO_CACHE": str(tmp_path_factory.mktemp("cache"))}
