"""A rank program for slurm/dapo.sbatch (ENTRY=rendezvous_probe) that checks the launch contract.

Run by srun on every task, with the arguments the trainer gets (CONFIG [key=value ...]):
it loads the config, joins the default group through megatron_dapo.parallel (which reads
SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and MASTER_ADDR / MASTER_PORT), all-reduces
rank + 1 over gloo and prints one line per rank.

With PROBE_WAIT_SIGNAL=1 it instead plays the trainer's side of the preemption contract,
so the batch script's requeue logic is tested before the trainer exists: on the first
attempt every rank waits for SIGUSR1/SIGTERM, rank 0 writes `<output_dir>/PREEMPTED` with
a step number, all exit 75 (EXIT_PREEMPTED, as the trainer does); later attempts exit 0 at once. This mode imports neither torch
nor megatron (seconds, not a minute, on a loaded 2-core machine).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from megatron_dapo.config.loader import load_config
from megatron_dapo.train import EXIT_PREEMPTED  # imports no torch

PREEMPT_STEP = 7
"""The step number the probe writes into PREEMPTED (the test reads it back from the log)."""


def rendezvous(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from megatron_dapo.parallel import destroy, init_distributed

    cfg = load_config(argv[0], argv[1:])
    env = init_distributed(device_kind="cpu")
    dp = cfg.check_world_size(env.world_size, "srun")
    total = torch.tensor([env.rank + 1.0])
    dist.all_reduce(total)
    print(f"probe rank {env.rank}/{env.world_size} local {env.local_rank} master {os.environ['MASTER_ADDR']}:"
          f"{os.environ['MASTER_PORT']} dp {dp} sum {int(total.item())}", flush=True)
    dist.barrier()
    destroy()
    return 0


def preempt(argv: list[str]) -> int:
    cfg = load_config(argv[0], argv[1:])
    rank, attempt = int(os.environ["SLURM_PROCID"]), os.environ.get("SLURM_RESTART_COUNT", "0")
    print(f"probe rank {rank} attempt {attempt}", flush=True)
    if attempt != "0":
        return 0
    received: list[int] = []
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    print(f"probe rank {rank} waiting for SIGUSR1", flush=True)
    deadline = time.monotonic() + 120
    while not received and time.monotonic() < deadline:
        time.sleep(0.2)
    if not received:
        print(f"probe rank {rank}: no signal within 120 s", flush=True)
        return 1
    # As train.py does once it decided on 75: the first rank to exit 75 makes srun
    # (--kill-on-bad-exit) SIGTERM the rest, and Python's shutdown puts SIGTERM's default action
    # back in place of a Python handler (not of SIG_IGN), so a rank still exiting died with 143
    # and the job was not requeued (seen in CI, 2026-11-29).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == 0:
        os.makedirs(cfg.trainer.output_dir, exist_ok=True)
        with open(os.path.join(cfg.trainer.output_dir, "PREEMPTED"), "w") as f:
            f.write(f"{PREEMPT_STEP}\n")
    print(f"probe rank {rank} got signal {signal.Signals(received[0]).name}", flush=True)
    return EXIT_PREEMPTED


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(preempt(args) if os.environ.get("PROBE_WAIT_SIGNAL") == "1" else rendezvous(args))
