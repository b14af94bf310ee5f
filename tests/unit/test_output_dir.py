"""The run directory before a run writes to it (megatron_dapo/output_dir.py), metrics.jsonl's
one-history rule, and a failed save's message (CheckpointManager.save)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import time
import traceback
from pathlib import Path

import pytest

from megatron_dapo.checkpoint.files import FORMAT_VERSION
from megatron_dapo.checkpoint.manager import CheckpointManager, os_error_in
from megatron_dapo.errors import UserError
from megatron_dapo.metrics import METRICS_FILENAME, MetricsLogger, read_metrics
from megatron_dapo.output_dir import (
    LOCK_FILENAME,
    LOCK_STALE_S,
    PREVIOUS_RUNS_DIRNAME,
    RunLock,
    check_output_dir,
    prepare_output_dir,
)


def _ckpt(root: Path, step: int) -> Path:
    path = root / f"step_{step}"
    (path / "dist").mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "step": step}))
    return path


def _metrics(out: Path, steps: list[int]) -> None:
    with MetricsLogger(out, "p", "e", use_wandb=False, total_steps=9, console=False) as m:
        for s in steps:
            m.log(s, {"x": float(s)})


def test_a_run_from_step_0_drops_every_line_of_the_crashed_attempt(tmp_path: Path) -> None:
    # Killed after step 1 with no checkpoint: the rerun starts at 0 and logs 0, 1, 2 again.
    _metrics(tmp_path, [0, 1])
    with MetricsLogger(tmp_path, "p", "e", use_wandb=False, total_steps=9, console=False) as m:
        assert m.truncate_after(-1) == 2
        for s in (0, 1, 2):
            m.log(s, {"x": float(s)})
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILENAME)] == [0, 1, 2]


def test_truncation_keeps_the_users_file_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        _metrics(tmp_path, [0, 1, 2])
        path = tmp_path / METRICS_FILENAME
        assert path.stat().st_mode & 0o777 == 0o644
        with MetricsLogger(tmp_path, "p", "e", use_wandb=False, total_steps=9, console=False) as m:
            assert m.truncate_after(1) == 1
        # mkstemp's replacement was 0600 before.
        assert path.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)


def test_output_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.write_text("x")
    with pytest.raises(UserError, match=r"^trainer.output_dir='.*out' is a file, not a directory; pick another"):
        prepare_output_dir(target, "auto")


def test_leftovers_go_first_and_resume_auto_keeps_the_history(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    _ckpt(ckpt, 2)
    (ckpt / ".tmp-step_4" / "dist").mkdir(parents=True)
    (ckpt / ".tmp-step_4" / "dist" / "big").write_bytes(b"0" * 1000)
    (tmp_path / ".metrics-abc.tmp").write_text("partial")
    _metrics(tmp_path, [0, 1, 2, 3])
    assert prepare_output_dir(tmp_path, "auto") is None
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", METRICS_FILENAME]


def test_resume_disable_moves_the_previous_run_aside(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    for s in (2, 4):
        _ckpt(ckpt, s)
    (ckpt / "latest").write_text("step_4\n")
    _metrics(tmp_path, [0, 1, 2, 3, 4])
    (tmp_path / "wandb_run_id.txt").write_text("abcd\n")
    archive = prepare_output_dir(tmp_path, "disable")
    assert archive is not None and archive.parent == tmp_path / PREVIOUS_RUNS_DIRNAME
    assert sorted(p.name for p in tmp_path.iterdir()) == [PREVIOUS_RUNS_DIRNAME]
    assert sorted(p.name for p in (archive / "checkpoints").iterdir()) == ["latest", "step_2", "step_4"]
    assert [r["step"] for r in read_metrics(archive / METRICS_FILENAME)] == [0, 1, 2, 3, 4]
    # A second fresh start in the same second gets its own archive.
    _metrics(tmp_path, [0])
    second = prepare_output_dir(tmp_path, "disable")
    assert second is not None and second != archive and (second / METRICS_FILENAME).is_file()
    # An empty directory has nothing to move.
    assert prepare_output_dir(tmp_path / "new", "disable") is None


def test_resuming_from_an_older_checkpoint_discards_the_newer_ones(tmp_path: Path) -> None:
    for s in (2, 4, 6):
        _ckpt(tmp_path, s)
    manager = CheckpointManager(tmp_path, keep_last=0)
    assert manager.discard_after(4) == [tmp_path / "step_6"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_4"]
    assert manager.latest() == tmp_path / "step_4"


def test_os_error_is_found_inside_torch_checkpoint_exceptions() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    disk_full = OSError(errno.ENOSPC, "No space left on device", "/x/__0_0.distcp")
    wrapped = CheckpointException("save failed", {1: (disk_full, traceback.extract_stack())})
    assert os_error_in(wrapped) == "No space left on device (errno 28, /x/__0_0.distcp)"
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system")
        except OSError as inner:
            raise RuntimeError("writer failed") from inner
    except RuntimeError as outer:
        assert os_error_in(outer) == "Read-only file system (errno 30)"
    assert os_error_in(RuntimeError("shape mismatch")) is None
    assert os_error_in(KeyboardInterrupt()) is None


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_truncation_on_a_full_disk_is_one_line_and_keeps_the_file(small_tmpfs: Path) -> None:
    _metrics(small_tmpfs, list(range(40)))
    path = small_tmpfs / METRICS_FILENAME
    before = path.read_bytes()
    # What a save that ran out of space leaves behind, filling the disk.
    filler = small_tmpfs / "checkpoints" / ".tmp-step_9" / "__0_0.distcp"
    filler.parent.mkdir(parents=True)
    with open(filler, "wb", buffering=0) as f, pytest.raises(OSError):
        while True:
            f.write(b"0" * 4096)
    with (MetricsLogger(small_tmpfs, "p", "e", use_wandb=False, total_steps=99, console=False) as m,
          pytest.raises(UserError, match=r"cannot rewrite .*metrics.jsonl .*\(No space left on device\); free space")):
        m.truncate_after(5)
    assert path.read_bytes() == before
    assert [p.name for p in small_tmpfs.iterdir() if p.name.startswith(".metrics-")] == []
    # The restart deletes the leftover before anything writes, so the rewrite now fits.
    prepare_output_dir(small_tmpfs, "auto")
    assert list((small_tmpfs / "checkpoints").iterdir()) == []
    with MetricsLogger(small_tmpfs, "p", "e", use_wandb=False, total_steps=99, console=False) as m:
        assert m.truncate_after(5) == 34


def test_read_only_output_dir_is_one_line(tmp_path: Path) -> None:
    mnt = tmp_path / "ro"
    (mnt / "existing").mkdir(parents=True)
    bound = subprocess.run(["mount", "--bind", str(mnt), str(mnt)], capture_output=True).returncode == 0
    if not bound or subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        pytest.skip("cannot make a read-only bind mount here (needs root)")
    try:
        with pytest.raises(UserError, match=r"^trainer.output_dir='.*ro/new' cannot be created \(Read-only file "
                                            r"system\); pick a writable trainer.output_dir$"):
            prepare_output_dir(mnt / "new", "auto")
        with pytest.raises(UserError, match=r"^trainer.output_dir='.*ro/existing' is not writable; pick a writable"):
            prepare_output_dir(mnt / "existing", "auto")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ------------------------------------------------------------------------ the run lock


def _write_holder(out: Path, **holder: object) -> Path:
    path = out / LOCK_FILENAME
    path.write_text(json.dumps(holder))
    return path


def test_a_second_trainer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    lock = RunLock.acquire(tmp_path)
    try:
        with pytest.raises(UserError) as err:
            RunLock.acquire(tmp_path)
        text = str(err.value)
        assert text.startswith(f"trainer.output_dir='{tmp_path}' is in use by another trainer (pid {os.getpid()} "
                               f"on host {socket.gethostname()}, since ")
        assert text.endswith(f"lock {tmp_path / LOCK_FILENAME}); wait for it to end or stop it, or pick another "
                             "trainer.output_dir")
        assert "\n" not in text
    finally:
        lock.release()
    assert not (tmp_path / LOCK_FILENAME).exists()
    RunLock.acquire(tmp_path).release()  # free again


def test_a_dead_holder_does_not_leave_the_directory_stuck(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    _write_holder(tmp_path, host=socket.gethostname(), pid=dead.pid, start="1", slurm_job_id=None, since="then")
    lock = RunLock.acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_FILENAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_reused_pid_is_not_the_holder(tmp_path: Path) -> None:
    # Our own pid, but another start time: the holder died and its pid was reused.
    _write_holder(tmp_path, host=socket.gethostname(), pid=os.getpid(), start="0", slurm_job_id=None, since="then")
    lock = RunLock.acquire(tmp_path)  # raises UserError if the stale holder still counted
    assert isinstance(lock, RunLock)
    lock.release()


def test_a_holder_on_another_host_counts_until_its_heartbeat_stops(tmp_path: Path, monkeypatch) -> None:
    path = _write_holder(tmp_path, host="node-elsewhere", pid=1, start="5", slurm_job_id="77", since="then")
    with pytest.raises(UserError, match=r"in use by another trainer \(pid 1 on host node-elsewhere, SLURM job 77, "):
        RunLock.acquire(tmp_path)
    old = time.time() - LOCK_STALE_S - 5
    os.utime(path, (old, old))
    RunLock.acquire(tmp_path).release()


def test_a_requeued_slurm_job_takes_its_own_lock_over(tmp_path: Path, monkeypatch) -> None:
    _write_holder(tmp_path, host="node-elsewhere", pid=1, start="5", slurm_job_id="77", since="then")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    lock = RunLock.acquire(tmp_path)  # raises UserError if job 77's own lock blocked its requeue
    assert isinstance(lock, RunLock)
    lock.release()


def test_a_lock_that_is_a_directory_is_refused_and_left_alone(tmp_path):
    """Issue 42: a `.run.lock` directory read as "in use by pid None", and a takeover renamed it to
    .run.lock.stale-<pid>, left behind. Now one line naming it and the fix; nothing is renamed."""
    (tmp_path / ".run.lock" / "x").mkdir(parents=True)
    with pytest.raises(UserError, match=r"\.run\.lock is a directory, not a trainer's lock file; remove it"):
        RunLock.acquire(tmp_path)
    with pytest.raises(UserError, match=r"\.run\.lock is a directory"):
        check_output_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run.lock"]
