"""Shared pytest setup: GPU-marked tests skip with a reason where CUDA is missing, and the
slow tiers are collected first.

`make test` runs the suite on two xdist workers, a test file at a time (`--dist loadfile`,
so a module's server or cluster fixture is started once); a worker takes the next file when
it is done with one. The tiers whose files take minutes (real servers, trainer runs) come
first, the unit tier's hundred small files last, so neither worker is left with a long file
while the other has nothing to do.
"""

import os

import pytest
import torch

# Keep every test process to the two cores CI has; spawned ranks inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


# Test directories, slowest files first (one core, 2026-11-26: sglang_cpu 12 min over 6 files,
# vllm_cpu 10 min over 5, e2e 18 min over 10, multirank 12 min over 26, unit 3 min over about
# 100). The slurm tier's file (3.5 min, mostly waiting on its daemons) goes early too: last, it
# was the one long file left while the other worker had nothing to do.
TIER_ORDER = ("sglang_cpu", "vllm_cpu", "slurm", "e2e", "multirank", "gpu", "unit")


def _tier(item: pytest.Item) -> int:
    parts = item.nodeid.split("/")
    name = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    return TIER_ORDER.index(name) if name in TIER_ORDER else len(TIER_ORDER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_tier)  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        # The marker, not item.keywords: keywords also hold every parent directory's name,
        # so a checkout in a directory called "gpu" skipped the whole suite.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
