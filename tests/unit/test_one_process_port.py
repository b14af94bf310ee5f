"""A one-process run picks its own rendezvous port; one taken before the store binds it is replaced."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import socket
import megatron_dapo.parallel as parallel
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen(1)  # what another process did with the port in between
picks = [taken.getsockname()[1]]
import megatron_dapo.launcher as launcher
real = launcher.free_port
launcher.free_port = lambda: picks.pop() if picks else real()
env = parallel.init_distributed("cpu", timeout_minutes=1)
import os, torch.distributed as dist
print(dist.get_world_size(), os.environ["MASTER_PORT"] != str(taken.getsockname()[1]))
"""


def test_a_port_taken_before_the_store_binds_it_is_replaced() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**env, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "True"]
