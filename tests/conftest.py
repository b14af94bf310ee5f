"""Shared pytest setup: GPU-marked tests skip with a reason where CUDA is missing."""

import os

import pytest
import torch

# Keep every test process to the two cores CI has; spawned ranks inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        # The marker, not item.keywords: keywords also hold every parent directory's name,
        # so a checkout in a directory called "gpu" skipped the whole suite.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
