"""The `slurm_cluster` session fixture: a real one-node SLURM cluster (see slurm_testbed.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from slurm_testbed import SlurmCluster, start_cluster, stop_cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """munged + slurmctld + slurmd on 127.0.0.1 for this session, stopped after it."""
    if os.geteuid() != 0:
        pytest.skip("the SLURM test cluster runs its daemons as root (SlurmUser=root); run pytest as root")
    cluster, procs = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        stop_cluster(procs)
