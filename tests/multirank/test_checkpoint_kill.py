"""kill -9 in the middle of a save leaves the previous checkpoint loadable and `latest` on it.

A child process (this file run as a script, so dist_checkpointing's spawn Manager can
re-import it) trains a tiny GPTModel, saves step 1, then starts saving step 2 and is
SIGKILLed at a chosen point of that save. The save is held at that point by wrapping one
internal call with a sleep, which is how a slow filesystem would stretch it. A second
child then resumes: it must get step 1 back bit-exactly, and its own save of step 2 must
clean up the leftover and publish.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
KILL_POINTS = ("shards_written", "before_publish", "before_latest")


def _child_save(root: Path, kill_point: str) -> None:
    """Save step 1, then step 2 stopped at kill_point (prints HOLD and sleeps there)."""
    import torch
    from test_checkpoint_layouts import _build, _train_step

    from megatron_dapo.checkpoint import dist_state, manager

    _, ddp, opt, sched = _build(tp=1, pp=1)
    mgr = manager.CheckpointManager(root / "ckpt", keep_last=2)
    _train_step(ddp, opt, sched, 0)
    mgr.save(1, [ddp], opt, sched, {"step": 1}, {"seed": 7})
    torch.save({n: p.detach().clone() for n, p in ddp.module.named_parameters()}, root / "step1_params.pt")
    _train_step(ddp, opt, sched, 1)

    def hold(original):
        def wrapper(*args, **kwargs):
            if kill_point == "shards_written":
                original(*args, **kwargs)
            print("HOLD", flush=True)
            time.sleep(600)

        return wrapper

    if kill_point == "shards_written":
        dist_state.fsync_tree = hold(dist_state.fsync_tree)
    elif kill_point == "before_publish":
        manager.CheckpointManager._publish = hold(manager.CheckpointManager._publish)
    else:
        manager.atomic_write_text = hold(manager.atomic_write_text)
    mgr.save(2, [ddp], opt, sched, {"step": 2}, {"seed": 7})


def _child_resume(root: Path) -> None:
    """Load latest, check it is step 1 with the saved weights, then save step 2 cleanly."""
    import torch
    from test_checkpoint_layouts import _build, _train_step

    from megatron_dapo import checkpoint

    _, ddp, opt, sched = _build(tp=1, pp=1)
    mgr = checkpoint.CheckpointManager(root / "ckpt", keep_last=2)
    latest = mgr.latest()
    state = mgr.load(latest, [ddp], opt, sched)
    expected = torch.load(root / "step1_params.pt", weights_only=True)
    same = all(torch.equal(p, expected[n]) for n, p in ddp.module.named_parameters())
    print(f"RESUMED {latest.name} step={state['step']} same_weights={same}", flush=True)
    _train_step(ddp, opt, sched, 1)
    mgr.save(2, [ddp], opt, sched, {"step": 2}, {"seed": 7})


def _child_disk_full(root: Path) -> None:
    """Save step 1, fill the disk, try step 2: one CheckpointError line, the tmp dir gone."""
    from test_checkpoint_layouts import _build, _train_step

    from megatron_dapo.checkpoint import CheckpointError, manager

    _, ddp, opt, sched = _build(tp=1, pp=1)
    mgr = manager.CheckpointManager(root / "ckpt", keep_last=2)
    _train_step(ddp, opt, sched, 0)
    mgr.save(1, [ddp], opt, sched, {"step": 1}, {"seed": 7})
    with open(root / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"0" * 65536)
        except OSError:
            pass
    _train_step(ddp, opt, sched, 1)
    try:
        mgr.save(2, [ddp], opt, sched, {"step": 2}, {"seed": 7})
    except CheckpointError as e:
        print(f"SAVE_FAILED {e}", flush=True)


def _spawn(log: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        cwd=ROOT / "tests" / "multirank",
        env=env,
        stdout=subprocess.PIPE,
        # A file, not a pipe: nobody reads stderr while the child runs, and a full pipe would block it.
        stderr=open(log, "w"),
        text=True,
        start_new_session=True,  # its own process group: the kill also reaches dist_checkpointing's Manager
    )


@pytest.mark.parametrize("kill_point", KILL_POINTS)
def test_kill_9_during_save_keeps_previous_checkpoint(tmp_path: Path, kill_point: str) -> None:
    from megatron_dapo.checkpoint import latest_checkpoint, read_manifest

    proc = _spawn(tmp_path / "save.log", "save", str(tmp_path), kill_point)
    deadline = time.monotonic() + 240
    line = ""
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith("HOLD"):
            break
    assert line.startswith("HOLD"), (tmp_path / "save.log").read_text()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    ckpt = tmp_path / "ckpt"
    names = sorted(p.name for p in ckpt.iterdir())
    if kill_point == "before_latest":
        # Renamed but the pointer not yet replaced: step_2 is complete, so it is the latest.
        assert names == ["latest", "step_1", "step_2"]
        assert (ckpt / "latest").read_text() == "step_1\n"
        assert latest_checkpoint(ckpt) == ckpt / "step_2"
        return
    assert names == [".tmp-step_2", "latest", "step_1"]
    assert (ckpt / "latest").read_text() == "step_1\n"
    assert latest_checkpoint(ckpt) == ckpt / "step_1"
    assert read_manifest(ckpt / "step_1")["step"] == 1

    resumed = _spawn(tmp_path / "resume.log", "resume", str(tmp_path))
    out, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, (tmp_path / "resume.log").read_text()[-3000:]
    assert "RESUMED step_1 step=1 same_weights=True" in out
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_1", "step_2"]
    assert (ckpt / "latest").read_text() == "step_2\n"


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_save_is_one_line_and_recoverable(tmp_path: Path, small_tmpfs: Path) -> None:
    from megatron_dapo.checkpoint import latest_checkpoint

    proc = _spawn(tmp_path / "full.log", "disk_full", str(small_tmpfs))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, (tmp_path / "full.log").read_text()[-3000:]
    ckpt = small_tmpfs / "ckpt"
    line = next(x for x in out.splitlines() if x.startswith("SAVE_FAILED"))
    # torch.save reports it as "basic_ios::clear: iostream error", with no errno: the free space tells.
    prefix, rest = line.split(" KiB free)", 1)
    assert prefix.startswith(f"SAVE_FAILED saving checkpoint step 2 to {ckpt} failed: No space left on device (")
    assert rest == (f"; the previous checkpoint {ckpt}/step_1 is intact. Free space (or fix the permissions) "
                    "and rerun the same command to resume")
    # The failed save's files are gone (before: .tmp-step_2 stayed and filled the disk).
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_1"]
    assert latest_checkpoint(ckpt) == ckpt / "step_1"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if sys.argv[1] == "save":
        _child_save(Path(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "disk_full":
        _child_disk_full(Path(sys.argv[2]))
    else:
        _child_resume(Path(sys.argv[2]))
