"""Per-rank RNG states (python, numpy, torch CPU/CUDA, megatron's model-parallel tracker).

Restoring them is what makes a resumed run draw the same dropout masks and samples as an
uninterrupted one. Only tensors and plain containers, so they load with weights_only=True.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """This rank's python, numpy, torch (CPU, CUDA) and megatron tracker RNG states.

    Only tensors and plain containers, so it round-trips through torch.load(weights_only=True).
    """
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    np_state = np.random.get_state(legacy=False)
    version, py_state, gauss = random.getstate()
    return {
        "python": {"version": version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        # On CPU the device layer maps torch.cuda's RNG to the CPU generator: nothing extra.
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of capture_rng_state."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": npy["bit_generator"],
            "state": {"key": npy["key"].numpy().astype(np.uint32), "pos": npy["pos"]},
            "has_gauss": npy["has_gauss"],
            "gauss": npy["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])
