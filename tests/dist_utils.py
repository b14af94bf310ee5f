"""Run a function on N spawned processes wired like torchrun, for the multi-rank test tier.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh interpreters
(torch.multiprocessing "spawn"), sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT
as torchrun would, so ``fn`` calls ``megatron_dapo.parallel.init_distributed()`` exactly as
production code does, and returns each rank's return value. A failing rank's traceback
text is raised in the test; the other ranks, likely stuck in a collective, are killed.
Results travel through files (torch.save), not pipes, so tensors are safe to return.

``fn`` must be importable by name (module level in a test module or here). On CPU the ranks
are forked from one forkserver that has imported megatron-core and torch.distributed once per
test session (``_FORKSERVER_PRELOAD``): a spawned rank spent about 6 s of a core importing them,
some 120 ranks per suite run. Each rank still starts clean: the forkserver has run no torch op,
no process group and no CUDA, and the rank takes the test process's environment as it is at
the call (a forked rank would otherwise keep the forkserver's). CUDA ranks are spawned.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

# Imported by the forkserver before it forks any rank: the costly imports every multi-rank test does.
_FORKSERVER_PRELOAD = [
    "torch.distributed",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron_dapo.parallel",
    "megatron_dapo.actor",
]


def _context(device_kind: str) -> Any:
    """forkserver (megatron preloaded) for CPU ranks; spawn for CUDA, whose tier runs rarely and was validated so."""
    if device_kind != "cpu":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


class WorkerError(RuntimeError):
    """A rank raised; the message holds its rank and traceback text."""


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0, device_kind: str = "cpu"
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks and return their results by rank.

    Args:
        fn: a module-level function; it runs after the torchrun env is set, with one
            thread per process. The harness destroys the process groups after it returns.
        world_size: number of processes.
        *args: picklable arguments passed to every rank.
        timeout_s: wall-clock limit for the whole run; ranks still alive are killed.
        device_kind: exported as MEGATRON_DAPO_TEST_DEVICE for fn to pass to init_distributed.

    Returns:
        ``[result_rank0, result_rank1, ...]``.

    Raises:
        WorkerError: a rank raised or died; the message carries its traceback or exit code.
        TimeoutError: ranks were still running after timeout_s.
    """
    # Imported here, not at module level: workers unpickle fn by importing this module,
    # and a failing-fast worker should not pay for importing megatron.
    from megatron_dapo.launcher import free_port

    ctx = _context(device_kind)
    for attempt in range(3):
        port = free_port()
        try:
            return _run_once(ctx, port, fn, world_size, args, timeout_s, device_kind)
        except WorkerError as err:
            # The port was free when picked and may be taken before rank 0's store binds it (the
            # other xdist worker's connection got it as its ephemeral port): pick another. Only the
            # store's own bind of this port; any other failure is the test's.
            if attempt == 2 or "EADDRINUSE" not in str(err) or f"port: {port}" not in str(err):
                raise
    raise AssertionError("unreachable")


def _run_once(ctx: Any, port: int, fn: Callable[..., Any], world_size: int, args: tuple[Any, ...],
              timeout_s: float, device_kind: str) -> list[Any]:
    """One try of run_distributed on `port`."""
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="dist_test_") as tmp:
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, tmp, device_kind, environ, fn, args),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            _wait(procs, Path(tmp), timeout_s)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=10)
        results = []
        for rank in range(world_size):
            status, payload = torch.load(Path(tmp) / f"rank{rank}.pt", weights_only=False)
            assert status == "ok", payload
            results.append(payload)
        return results


def _wait(procs: list[Any], tmp: Path, timeout_s: float) -> None:
    """Block until all ranks exit; raise on the first failure or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for rank, proc in enumerate(procs):
            result = tmp / f"rank{rank}.pt"
            if proc.exitcode is None:
                alive.append(rank)
                continue
            if not result.exists():
                raise WorkerError(f"rank {rank} died with exit code {proc.exitcode} and no result")
            status, payload = torch.load(result, weights_only=False)
            if status != "ok":
                raise WorkerError(f"rank {rank} raised:\n{payload}")
        if not alive:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks {alive} still running after {timeout_s:.0f}s (deadlock or slow test)")
        time.sleep(0.05)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    tmp: str,
    device_kind: str,
    environ: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        MEGATRON_DAPO_TEST_DEVICE=device_kind,
    )
    torch.set_num_threads(1)
    out = Path(tmp) / f"rank{rank}.pt"
    partial = Path(tmp) / f"rank{rank}.pt.tmp"
    try:
        payload: tuple[str, Any] = ("ok", fn(*args))
    except BaseException:
        payload = ("error", traceback.format_exc())
    finally:
        # Only tear down what fn set up: importing megatron just to destroy nothing costs seconds.
        parallel = sys.modules.get("megatron_dapo.parallel")
        if parallel is not None:
            parallel.destroy()
        elif torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # Written then renamed, so the parent never reads a half-written result.
    try:
        torch.save(payload, partial)
    except Exception:
        payload = ("error", f"the return value of {fn.__name__} cannot be saved:\n{traceback.format_exc()}")
        torch.save(payload, partial)
    partial.rename(out)
