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
import json
import logging
import os
import shutil
import socket
import threading
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
    check_output_dir(output_dir)
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


def check_output_dir(output_dir: Path) -> None:
    """What prepare_output_dir would refuse, without creating anything (`config validate`).

    Raises:
        UserError: a file of that name, or a directory (or its nearest existing parent) this
            process cannot write.
    """
    where = "trainer.output_dir"
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"{where}={str(output_dir)!r} is a file, not a directory; pick another trainer.output_dir")
    existing = output_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{where}={str(output_dir)!r} cannot be created: {existing} is a file; "
                        "pick another trainer.output_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        what = "is not writable" if existing == output_dir else \
            f"cannot be created ({'Read-only file system' if read_only else 'Permission denied'})"
        raise UserError(f"{where}={str(output_dir)!r} {what}; pick a writable trainer.output_dir")
    _check_lock_path(output_dir / LOCK_FILENAME, output_dir)


def _check_lock_path(path: Path, output_dir: Path) -> None:
    """A lock path that is not a regular file (a directory made by hand) is no trainer's lock."""
    if (path.exists() and not path.is_file()) or (path.is_symlink() and not path.exists()):
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise UserError(f"trainer.output_dir={str(output_dir)!r}: {path} is {kind}, not a trainer's lock "
                        f"file; remove it (rm -r {path}) if no trainer uses this output_dir")


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


# ------------------------------------------------------------------------ one run per directory

LOCK_FILENAME = ".run.lock"
# The holder refreshes its lock file's mtime this often; a holder on another host whose file
# is older than LOCK_STALE_S is gone (node lost, kill -9). Same-host holders are checked by pid.
LOCK_HEARTBEAT_S = 30.0
LOCK_STALE_S = 180.0


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (/proc/<pid>/stat field 22), None if it is not running.

    With the pid it tells a live holder from a new process that reuses a dead holder's pid.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class RunLock:
    """The exclusive claim of one trainer on its output_dir (`<output_dir>/.run.lock`).

    Two trainers in one directory delete each other's temporary checkpoints and interleave
    metrics.jsonl, so the controller takes this lock before anything else writes there. It
    is a file created with O_CREAT | O_EXCL (atomic on local disks, NFS v3+ and Lustre,
    unlike flock, which Lustre mounted with `localflock` keeps per node), holding who took
    it: host, pid and its start time, the SLURM job id. A lock whose holder is gone is
    taken over with a warning: on the same host when the pid no longer runs (or is another
    process now), on another host when the holder stopped refreshing the file's mtime for
    LOCK_STALE_S, or at once when it names this process's own SLURM job id (a requeued job
    is the only incarnation SLURM runs).
    """

    def __init__(self, path: Path, token: str) -> None:
        self.path = path
        self.token = token
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="run-lock", daemon=True)
        self._beat.start()

    @classmethod
    def acquire(cls, output_dir: Path) -> RunLock:
        """Take the lock of `output_dir` (which must exist).

        Raises:
            UserError: another live trainer holds it (named by pid, host and job).
        """
        path = output_dir / LOCK_FILENAME
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid()),
              "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "since": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                      time.gmtime())}
        token = json.dumps(me, sort_keys=True)
        for _ in range(3):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                # Not ours to remove: a directory here was made by hand (or by a tool), and renaming
                # it away as a stale lock left it behind as .run.lock.stale-<pid>.
                _check_lock_path(path, output_dir)
                raw = _read_text(path)
                holder = _read_holder(path)
                why = _stale(holder, path, me)
                if why is None:
                    raise UserError(
                        f"trainer.output_dir={str(output_dir)!r} is in use by another trainer (pid "
                        f"{holder.get('pid')} on host {holder.get('host')}"
                        + (f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else "")
                        + f", since {holder.get('since')}; lock {path}); wait for it to end or stop it, or pick "
                        "another trainer.output_dir") from None
                if _read_text(path) != raw:  # taken over meanwhile: judge the new holder
                    continue
                # Rename, not unlink: of two trainers taking over at once only one rename succeeds.
                with contextlib.suppress(FileNotFoundError):
                    os.rename(path, path.with_name(f"{LOCK_FILENAME}.stale-{os.getpid()}"))
                    os.unlink(path.with_name(f"{LOCK_FILENAME}.stale-{os.getpid()}"))
                    logger.warning("took over the lock of %s from a trainer that is gone (%s; %s)", output_dir,
                                   _describe_holder(holder), why)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
                f.flush()
                os.fsync(f.fileno())
            return cls(path, token)
        raise UserError(f"trainer.output_dir={str(output_dir)!r}: could not take the lock {path} (other trainers keep "
                        "taking it); start one trainer per output_dir")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still this run's."""
        self._stop.set()
        if _read_text(self.path).strip() == self.token:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _heartbeat(self) -> None:
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _read_holder(path: Path) -> dict:
    try:
        holder = json.loads(_read_text(path) or "{}")
    except ValueError:
        holder = {}
    return holder if isinstance(holder, dict) else {}


def _describe_holder(holder: dict) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')}"


def _stale(holder: dict, path: Path, me: dict) -> str | None:
    """Why the holder is gone, or None while it may still run."""
    if not holder:
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return "the lock disappeared"
        # A holder between O_EXCL and its write: give it a moment.
        return "an unreadable lock file" if age > 10 else None
    if me["slurm_job_id"] and holder.get("slurm_job_id") == me["slurm_job_id"]:
        return f"an earlier run of this SLURM job {me['slurm_job_id']}"
    if holder.get("host") == me["host"]:
        pid = holder.get("pid")
        if not isinstance(pid, int) or _process_start(pid) != holder.get("start"):
            return f"pid {pid} is no longer running"
        return None
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "the lock disappeared"
    return f"no heartbeat for {age:.0f} s" if age > LOCK_STALE_S else None
