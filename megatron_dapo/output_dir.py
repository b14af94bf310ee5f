"""The run directory before a run writes to it, and the one rule that keeps its history single.

`prepare_output_dir` runs on the controller before anything else writes to
`trainer.output_dir`, in this order:

1. the directory is created, or the run stops with one line when it cannot be (a file
   of that name, no permission, a read-only disk);
2. what interrupted work left behind is deleted: `checkpoints/.tmp-*` (a save killed or
   out of space) and `.metrics-*.tmp` (a metrics rewrite killed). It comes first because
   after a disk-full crash it is what fills the disk, and any other write would fail;
3. a fresh run (`trainer.resume=disable`) in a used directory moves the previous run's
   checkpoints, metrics.jsonl and wandb id into `previous_runs/<UTC time>/`: nothing is
   deleted, and a later `resume=auto` can only find this run's checkpoints.

The rule for metrics.jsonl (applied by build_run once the resume point is known): it
keeps exactly the steps of the checkpoint the run continues from, and nothing when it
starts from step 0. Every line written after that point belongs to the new attempt, so
after any crash and a rerun of the same command each step appears once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

from megatron_dapo.checkpoint.files import TMP_PREFIX
from megatron_dapo.errors import UserError
from megatron_dapo.metrics import METRICS_FILENAME, METRICS_TMP_PREFIX, WANDB_ID_FILENAME

logger = logging.getLogger(__name__)

CHECKPOINTS_DIRNAME = "checkpoints"
PREVIOUS_RUNS_DIRNAME = "previous_runs"
# What belongs to one run's history; moved together when a fresh run starts in the directory.
RUN_HISTORY = (CHECKPOINTS_DIRNAME, METRICS_FILENAME, WANDB_ID_FILENAME)


def prepare_output_dir(output_dir: Path, resume: str) -> Path | None:
    """Make `output_dir` ready for a run (controller only, before any other write).

    Args:
        output_dir: trainer.output_dir.
        resume: trainer.resume ("auto", "disable" or a checkpoint path).

    Returns:
        The `previous_runs/<time>` directory the previous run was moved to, or None.

    Raises:
        UserError: the directory cannot be created or written.
    """
    where = "trainer.output_dir"
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"{where}={str(output_dir)!r} is a file, not a directory; pick another trainer.output_dir")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{where}={str(output_dir)!r} cannot be created ({os_reason(e)}); "
                        "pick a writable trainer.output_dir") from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise UserError(f"{where}={str(output_dir)!r} is not writable; pick a writable trainer.output_dir")
    freed = remove_leftovers(output_dir)
    if freed:
        logger.warning("removed %d leftover(s) of interrupted work in %s: %s", len(freed), output_dir,
                       ", ".join(sorted(p.name for p in freed)))
    if resume != "disable":
        return None
    found = [name for name in RUN_HISTORY if (output_dir / name).exists()]
    if not found:
        return None
    archive = output_dir / PREVIOUS_RUNS_DIRNAME / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    while archive.exists():  # two fresh starts within one second
        archive = archive.with_name(archive.name + "_")
    try:
        archive.mkdir(parents=True)
        for name in found:
            os.rename(output_dir / name, archive / name)
    except OSError as e:
        raise UserError(f"{where}={str(output_dir)!r}: cannot move the previous run to {archive} "
                        f"({os_reason(e)}); free space or pick a new trainer.output_dir") from None
    logger.warning("trainer.resume=disable: the previous run in %s (%s) was moved to %s; this run starts at step 0",
                   output_dir, ", ".join(found), archive)
    return archive


def remove_leftovers(output_dir: Path) -> list[Path]:
    """Delete unfinished work: `checkpoints/.tmp-*` and `.metrics-*.tmp`; returns what was removed."""
    candidates = [p for p in output_dir.glob(f"{METRICS_TMP_PREFIX}*.tmp")]
    ckpt = output_dir / CHECKPOINTS_DIRNAME
    if ckpt.is_dir():
        candidates += [p for p in ckpt.iterdir() if p.name.startswith(TMP_PREFIX)]
    removed = []
    for p in candidates:
        with contextlib.suppress(OSError):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
    return removed


def os_reason(e: OSError) -> str:
    """`No space left on device` style text of an OSError, without its traceback."""
    if e.errno is not None:
        return os.strerror(e.errno)
    return str(e) or type(e).__name__
