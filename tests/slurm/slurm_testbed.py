"""A real one-node SLURM cluster on the loopback for the `slurm` tests (started by conftest.py).

The session fixture `slurm_cluster` installs Debian's slurm-wlm daemons and munge when
they are missing (apt-get, so root only), writes a private slurm.conf for this machine
(its real CPU count and memory, 127.0.0.1, free ports, every state file in a temporary
directory), starts munged, slurmctld and slurmd in the foreground as child processes and
waits until `sinfo` reports the node idle. Teardown stops exactly those three processes.
Nothing under /etc is modified: the client commands find the private config through
SLURM_CONF, and munge uses a private key and socket.

What the tests cover with it: our sbatch scripts under the real srun (task environment,
MASTER_ADDR, per-job logs), the pre-timeout signal and `scontrol requeue`.

A second node, `localhost` (a second slurmd on this machine, on a port of its own), is in the
partition `split` with the first, for jobs that give a rollout fleet a node of its own
(test_slurm_fleet.py); the default partition holds the first node alone, so the other jobs
never land there. Its name resolves on every machine, which the fleet needs (the trainer calls
its servers at the node's address); SLURM's slurmd accepts `-N name` in Debian's build.

With that node, both nodes offer `gpu` GRES (ENGINE_GPUS each, as GPU nodes of a real cluster
are alike, so a two-node job can ask `--gres=gpu:N` per node): character devices made under the
cluster's directory with the NVIDIA major number, named in a gres.conf beside slurm.conf. No
GPU is behind them; what they give is SLURM's own GPU accounting (a step's `--gres=gpu:N`,
the CUDA_VISIBLE_DEVICES slurmstepd sets, steps that wait for busy GPUs), which the GPU fleet's
launcher relies on (test_slurm_fleet.py). Where devices cannot be made (no CAP_MKNOD) the nodes
have none and those tests skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tiers import unavailable

REPO = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "slurmctld", "slurmd")
# Debian packages providing the daemons and the client commands (sbatch, srun, scontrol).
APT_PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
ENGINE_GPUS = 2
"""GPU GRES of each node when there are two (device files only)."""


@dataclass(frozen=True, slots=True)
class SlurmCluster:
    """Handle on the running test cluster."""

    root: Path
    """Temporary directory holding the config, state, spool and daemon logs."""
    conf: Path
    """The slurm.conf the daemons and clients use (exported as SLURM_CONF)."""
    node: str
    """Name of the first node (this machine's hostname); the default partition's only node."""
    engine_node: str | None
    """The second node of partition `split` (None when this machine's hostname is localhost)."""
    cpus: int
    """CPUs the node offers."""
    engine_gpus: int
    """`gpu` GRES of each node when there are two (0 when the device files could not be made)."""
    env: dict[str, str]
    """Environment for client commands (sbatch, squeue, scontrol ...)."""

    def run(self, *args: str, check: bool = True, timeout: float = 60, cwd: Path = REPO,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against this cluster and capture its output."""
        return subprocess.run(list(args), env={**self.env, **(env or {})}, cwd=cwd, text=True,
                              capture_output=True, timeout=timeout, check=check)

    def job_field(self, job_id: str, field: str) -> str:
        """One field (JobState, Restarts, ExitCode ...) of `scontrol show job`."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        for token in out.split():
            key, _, value = token.partition("=")
            if key == field:
                return value
        raise KeyError(f"{field} not in scontrol output: {out}")

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> str:
        """Poll until the job's state is one of `states`; returns it."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_field(job_id, "JobState")
            if state in states:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {state} after {timeout}s; wanted one of {sorted(states)}; "
                           f"slurmctld log tail:\n{self.log_tail('slurmctld')}")

    def log_tail(self, daemon: str, lines: int = 30) -> str:
        """Last lines of a daemon's log, for failure messages."""
        path = self.root / "log" / f"{daemon}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _bin(name: str) -> str:
    """Full path of a SLURM/munge program; daemons live in /usr/sbin, often not on a CI PATH."""
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _missing_binaries() -> list[str]:
    return [b for b in (*DAEMONS, "sbatch", "srun", "scontrol", "sinfo") if not Path(_bin(b)).exists()]


def _install_or_skip() -> None:
    if not _missing_binaries():
        return
    if os.geteuid() != 0:
        unavailable(f"SLURM is not installed ({', '.join(_missing_binaries())} missing) and installing it "
                    "needs root: run as root or `apt-get install munge slurmctld slurmd slurm-client`")
    if shutil.which("apt-get") is None:
        unavailable("SLURM is not installed and apt-get is unavailable; install munge + slurmctld + slurmd + "
                    "slurm-client from the distribution")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *APT_PACKAGES]):
        proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=900)
        if proc.returncode != 0:
            unavailable(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
    if _missing_binaries():
        unavailable(f"after apt-get install, still missing: {', '.join(_missing_binaries())}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _node_resources() -> tuple[int, int]:
    """(CPUs, RealMemory MiB) as slurmd itself reports them, so the node is never drained."""
    out = subprocess.run([_bin("slurmd"), "-C"], text=True, capture_output=True, check=True).stdout
    fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
    # The tests run 2-task jobs: offer at least 2 CPUs (config_overrides below lets a
    # 1-CPU machine oversubscribe instead of leaving the jobs pending forever). Leave 5% of
    # memory out, as slurmd measures it slightly differently at each start.
    return max(2, int(fields["CPUs"])), int(int(fields["RealMemory"]) * 0.95)


def _make_gpu_devices(root: Path, names: list[str], count: int) -> int:
    """`count` character devices root/dev/<node>/nvidia<i> per node (NVIDIA's major, 195); `count`,
    or 0 when they could not be made."""
    import stat

    for name in names:
        (root / "dev" / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            try:
                os.mknod(root / "dev" / name / f"nvidia{i}", stat.S_IFCHR | 0o666, os.makedev(195, i))
            except OSError:
                return 0
    return count


def _write_conf(root: Path, node: str, cpus: int, mem_mb: int, munge_socket: Path, engine_node: str | None,
                engine_gpus: int = 0) -> Path:
    for sub in ("state", "spool", "log", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for name in (node, engine_node):
        if name:
            (root / "spool" / name).mkdir(exist_ok=True)
    gres = f" Gres=gpu:{engine_gpus}" if engine_node and engine_gpus else ""
    second = [f"NodeName={engine_node} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={cpus} RealMemory={mem_mb}{gres} "
              "State=UNKNOWN", f"PartitionName=split Nodes={node},{engine_node} MaxTime=INFINITE State=UP"] \
        if engine_node else []
    if gres:
        (root / "gres.conf").write_text("AutoDetect=off\n" + "".join(
            f"NodeName={name} Name=gpu File={root / 'dev' / name}/nvidia[0-{engine_gpus - 1}]\n"
            for name in (node, engine_node)))
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=megatron-dapo-test",
        *(["GresTypes=gpu"] if engine_node and engine_gpus else []),
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={root / 'state'}",
        # %n: each slurmd (one per node name, both on this machine) keeps its own files.
        f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'run'}/slurmd-%n.pid",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log'}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # No cgroups in a container: track processes by parentage, bind nothing.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        # Trust this file's CPUs/RealMemory instead of draining the node over a mismatch.
        "SlurmdParameters=config_overrides",
        # The preemption test requeues a job: requeue must be allowed, and finished jobs
        # stay visible to `scontrol show job` for the whole session (no slurmdbd here).
        "JobRequeue=1",
        "MinJobAge=3600",
        "KillWait=10",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb}{gres} State=UNKNOWN",
        f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        *second,
        "",
    ]))
    return conf


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_idle(cluster: SlurmCluster, procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    state = ""
    names = [*DAEMONS[:2], *(f"slurmd-{n}" for n in (cluster.node, cluster.engine_node) if n)]
    # A node in two partitions is listed once per partition.
    want = {f"{n} idle" for n in (cluster.node, cluster.engine_node) if n}
    while time.monotonic() < deadline:
        for name, proc in zip(names, procs):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{cluster.log_tail(name)}")
        out = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=10)
        state = out.stdout.strip()
        if set(state.splitlines()) == want:
            return
        time.sleep(0.5)
    raise RuntimeError(f"nodes not idle after {timeout}s (sinfo: {state!r});\n{cluster.log_tail(f'slurmd-{cluster.node}')}")


def start_cluster(root: Path) -> tuple[SlurmCluster, list[subprocess.Popen[bytes]]]:
    """Configure and start munged + slurmctld + slurmd under `root`; returns the handle and the processes.

    Installs SLURM first when it is missing (skips the test when that cannot be done).
    """
    _install_or_skip()
    node = socket.gethostname().split(".")[0]
    cpus, mem_mb = _node_resources()
    munge_dir = root / "munge"
    munge_dir.mkdir(mode=0o700)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge_socket = munge_dir / "munge.socket"
    engine_node = "localhost" if node != "localhost" else None
    gpus = _make_gpu_devices(root, [node, engine_node], ENGINE_GPUS) if engine_node else 0
    conf = _write_conf(root, node, cpus, mem_mb, munge_socket, engine_node, gpus)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for var in [v for v in env if v.startswith(("SLURM_", "SBATCH_", "SRUN_")) and v != "SLURM_CONF"]:
        del env[var]  # a pytest started inside a job must not leak its job's settings
    cluster = SlurmCluster(root=root, conf=conf, node=node, engine_node=engine_node, cpus=cpus, engine_gpus=gpus,
                           env=env)
    log = root / "log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_start([_bin("munged"), "-F", "--force", f"--socket={munge_socket}", f"--key-file={key}",
                             f"--pid-file={munge_dir / 'munged.pid'}", f"--seed-file={munge_dir / 'seed'}",
                             f"--log-file={log / 'munged.log'}"], log / "munged.out", env))
        for _ in range(100):
            if munge_socket.exists():
                break
            time.sleep(0.1)
        # -i: ignore saved state (a fresh directory has none).
        procs.append(_start([_bin("slurmctld"), "-D", "-i", "-f", str(conf)], log / "slurmctld.out", env))
        for name in (node, engine_node):
            if name:
                procs.append(_start([_bin("slurmd"), "-D", "-f", str(conf), "-N", name], log / f"slurmd-{name}.out", env))
        _wait_idle(cluster, procs, timeout=60)
    except BaseException:
        stop_cluster(procs)
        raise
    return cluster, procs


def stop_cluster(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop the daemons start_cluster started (slurmd first), and only those."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
