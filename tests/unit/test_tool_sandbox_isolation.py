"""The python tool's jail against a hostile policy, as root and as an ordinary user (issue 58).

A runner process stands in for the trainer: it runs each attack through run_python, as the
trainer would, next to an "engine" of the same user that holds VLLM_API_KEY in its
environment and listens on 127.0.0.1. As root (CI) the runner is root; for the ordinary user
this test creates one (``useradd``) and drops to it in the subprocess (setresuid, no groups,
as setpriv does), so both ways users run
are covered on every CI run. Each case fails if its guard is taken away (where two layers
guard, e.g. the fixed environment of both the jail and the code, or the sessions of both, when
both are; as root the nobody uid is a further layer under most cases):

- killing the ancestors, the process group, every process (kill -1): the PID namespace (the
  code's parent is the namespace's init, which it cannot signal), the code's own session,
  the trainer's session for the jail;
- another process's environ: the fresh /proc of the PID namespace;
- the engine's port: the network namespace;
- writes outside scratch, reads of the run's files: the new root (pivot_root), the scratch
  tmpfs at /tmp, /var/tmp, /dev/shm and /run/lock;
- SysV and POSIX shared memory: the IPC namespace and the scratch tmpfs;
- a fork loop: RLIMIT_NPROC, counted in the call's user namespace;
- a setsid()'d child: the namespace dies with its init when the code exits;
- unshare/mount/umount: no capabilities, nested user namespaces off, locked mounts;
- kill -9 of the trainer: PR_SET_PDEATHSIG down the jail's processes;
- a venv under /tmp: the prefix bound onto the private /tmp after it is made;
- a machine without namespaces (root, chroot, no CAP_SYS_ADMIN): config validate's probe.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "megatron_dapo" / "tools"
USER = "dapotest"
SECRET = f"secret-{uuid.uuid4().hex}"
ANSWER = f"answer-{uuid.uuid4().hex}"

RUNNER = r'''
import importlib.util, json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("sandbox", os.path.join(here, "sandbox.py"))
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)
job = json.loads(open(sys.argv[1]).read())  # not argv: the markers the test looks for are in the programs
limits = sandbox.SandboxLimits(timeout_s=15, cpu_seconds=10, processes=8)
out = {}
for name, code in job["attacks"].items():
    r = sandbox.run_python(code, limits)
    out[name] = {"status": r.status, "text": r.text, "isolation": r.isolation}
    print(json.dumps({name: out[name]}), flush=True)
print(json.dumps({"runner_alive": True}), flush=True)
'''


def _readable_python(uid: int, gid: int) -> str | None:
    """A Python the user uid can run (every directory on its way and its stdlib readable)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            out = subprocess.run([candidate, "-I", "-c", "import json; print('ok')"], capture_output=True, text=True,
                                 timeout=30, user=uid, group=gid, extra_groups=[], cwd="/")
        except (OSError, subprocess.SubprocessError):
            continue
        if out.stdout.strip() == "ok":
            return candidate
    return None


class Actor:
    """Runs processes as root or as the ordinary user; where its files go."""

    def __init__(self, kind: str, base: Path) -> None:
        self.kind = kind
        if kind == "root":
            if os.geteuid() != 0:
                pytest.skip("the root case needs root (CI runs as root)")
            self.drop: dict = {}
            self.python = sys.executable  # the trainer's own, under root's 0700 home here: bound into the jail
            self.uid = self.gid = 0
            self.home = Path(pwd.getpwuid(0).pw_dir)
        elif os.geteuid() != 0:  # already an ordinary user
            self.drop, self.python = {}, sys.executable
            self.uid, self.gid = os.getuid(), os.getgid()
            self.home = Path.home()
        else:
            try:
                entry = pwd.getpwnam(USER)
            except KeyError:
                made = subprocess.run(["useradd", "-m", "-s", "/bin/sh", USER], capture_output=True, text=True)
                if made.returncode != 0:
                    pytest.skip(f"NOT TESTED as an ordinary user: useradd {USER} failed: {made.stderr.strip()}")
                entry = pwd.getpwnam(USER)
            self.uid, self.gid, self.home = entry.pw_uid, entry.pw_gid, Path(entry.pw_dir)
            python = _readable_python(self.uid, self.gid)
            if python is None:
                pytest.skip(f"NOT TESTED as an ordinary user: no Python here that {USER} can run")
            self.python = python
            # Like setpriv --reuid/--regid --clear-groups, without its capabilities kept until the exec.
            self.drop = {"user": self.uid, "group": self.gid, "extra_groups": []}
        self.base = base
        shutil.copy(TOOLS / "sandbox.py", base / "sandbox.py")
        shutil.copy(TOOLS / "jail.py", base / "jail.py")
        (base / "isolation_runner.py").write_text(RUNNER)
        os.chmod(base, 0o755)
        self.env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.home), "LANG": "C.UTF-8",
                    "HF_TOKEN": SECRET}

    def popen(self, args: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen([self.python, "-I", *args], env={**self.env, **(env or {})}, cwd=self.base,
                                start_new_session=True, **self.drop, **kw)

    def job(self, job: dict) -> str:
        path = self.base / "job.json"
        path.write_text(json.dumps(job))
        os.chmod(path, 0o644)
        return str(path)

    def own(self, path: Path) -> Path:
        os.chown(path, self.uid, self.gid)
        return path


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _pids_with(needle: bytes) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if needle in Path(f"/proc/{entry}/cmdline").read_bytes() and _alive(int(entry)):
                    found.append(int(entry))
            except OSError:
                pass
    return found


def _attacks(m: str, engine_pid: int, port: int, rundir: Path, cachedir: Path, home: Path,
             shm_key: int) -> tuple[list[str], dict[str, str]]:
    """The paths the write attack tries, and name -> program of every attack."""
    writes = [f"/tmp/{m}", f"/run/lock/{m}", f"/var/tmp/{m}", f"/dev/shm/{m}", f"{rundir}/{m}", f"{REPO}/{m}",
              f"{home}/{m}"]
    reads = [f"{rundir}/answers.txt", f"{cachedir}/answers.txt", f"{REPO}/pyproject.toml"]
    return writes, {
        "kill_ancestors": (
            "import os, signal\npid = os.getppid()\nwhile pid > 0:\n    try:\n"
            "        cmd = open(f'/proc/{pid}/cmdline', 'rb').read()\n"
            "        ppid = int(open(f'/proc/{pid}/status').read().split('PPid:')[1].split()[0])\n"
            "    except OSError:\n        cmd, ppid = b'', 0\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
            "    if b'isolation_runner' in cmd:\n        break\n    pid = ppid\nprint('done')\n"),
        "kill_group": "import os, signal\nos.killpg(0, signal.SIGKILL)\n",
        "kill_all": ("import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    print(e)\n"
                     "print('survived')\n"),
        "environ": (
            f"import os\nfound = []\nfor p in [{engine_pid}] + [int(x) for x in os.listdir('/proc') if x.isdigit()]:\n"
            "    try:\n        found.append(open(f'/proc/{p}/environ', 'rb').read().decode(errors='replace'))\n"
            "    except OSError as e:\n        found.append(str(e))\n"
            "print(found, dict(os.environ))\n"),
        "connect": (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
                    "print('CONNECTED', s.recv(100))\n"),
        "write": (f"for p in {writes!r}:\n    try:\n        open(p, 'w').write('x')\n        print('wrote', p)\n"
                  "    except OSError as e:\n        print('refused', p, e)\n"),
        "read": (f"for p in {reads!r}:\n    try:\n        print(p, open(p).read()[:2000])\n"
                 "    except OSError as e:\n        print('refused', p, e)\n"),
        "shm": ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                f"shmid = libc.shmget({shm_key}, 1 << 20, 0o1000 | 0o666)\nprint('shmget', shmid, ctypes.get_errno())\n"
                f"open('/dev/shm/{m}-posix', 'wb').write(b'x' * 4096)\nprint('posix')\n"),
        "fork_loop": ("import os, time\nn = 0\nfor _ in range(64):\n    try:\n        pid = os.fork()\n"
                      "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n"
                      "    n += 1\nprint('forked', n)\n"),
        "setsid_child": ("import os\nif os.fork() == 0:\n    os.setsid()\n"
                         f"    os.execv('/bin/sleep', ['sleep', '{_sleep_mark(m)}'])\nprint('left a child')\n"),
        "mount": ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                  "print('unshare', libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())\n"
                  "print('remount', libc.mount(None, b'/usr', None, 0x20 | 0x1000, None), ctypes.get_errno())\n"
                  "print('umount', libc.umount2(b'/tmp', 2), ctypes.get_errno())\n"
                  f"try:\n    open('/usr/{m}', 'w').write('x')\n    print('wrote /usr')\nexcept OSError as e:\n"
                  "    print('refused', e)\nprint('tmp', sorted(os.listdir('/tmp')))\n"),
    }


def _sleep_mark(m: str) -> str:
    return f"400.{int(m[-8:], 16) % 10**8}"


@pytest.fixture(scope="module", params=["root", "user"])
def attacked(request):
    """Every attack run once by a trainer stand-in as this user; (results, what the host saw after)."""
    base = Path(tempfile.mkdtemp(prefix="mdapo-isolation-"))
    try:
        actor = Actor(request.param, base)
    except BaseException:  # a skip included
        shutil.rmtree(base, ignore_errors=True)
        raise
    m = f"mdapo-{uuid.uuid4().hex}"
    rundir = actor.home / f"{m}-run"
    cachedir = actor.home / ".cache" / "megatron-dapo" / m
    host_marker = Path("/tmp") / f"{m}-host"
    host_marker.write_text("x")
    shm_key = 0x5EED0000 + uuid.uuid4().int % 0xFFFF
    engine = None
    try:
        rundir.mkdir(exist_ok=True)
        actor.own(rundir)
        cachedir.mkdir(parents=True, exist_ok=True)
        for p in (rundir / "answers.txt", cachedir / "answers.txt"):
            p.write_text(ANSWER)
            actor.own(p)
        engine = actor.popen(["-c", "import socket, sys, time\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\n"
                              "s.listen()\nprint(s.getsockname()[1], flush=True)\nwhile True:\n"
                              "    c, _ = s.accept()\n    c.sendall(b'HTTP/1.0 200 OK')\n    c.close()\n"],
                             env={"VLLM_API_KEY": SECRET}, stdout=subprocess.PIPE, text=True)
        port = int(engine.stdout.readline())
        writes, attacks = _attacks(m, engine.pid, port, rundir, cachedir, actor.home, shm_key)
        job = {"attacks": attacks}
        runner = actor.popen(["isolation_runner.py", actor.job(job)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        out, _ = runner.communicate(timeout=240)
        results: dict = {}
        for line in out.splitlines():
            try:
                results.update(json.loads(line))
            except ValueError:
                results.setdefault("runner_output", []).append(line)
        leftover = {
            "files": [p for p in (*writes, f"/usr/{m}", f"/dev/shm/{m}-posix") if Path(p).exists()],
            "shm": [line for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
                    if int(line.split()[0]) == shm_key],
            "sleepers": _pids_with(_sleep_mark(m).encode()),
            "engine_alive": _alive(engine.pid),
            "runner_code": runner.returncode,
        }
        yield results, leftover, m
    finally:
        if engine is not None:
            engine.kill()
            engine.wait()
        for pid in _pids_with(_sleep_mark(m).encode()):
            os.kill(pid, signal.SIGKILL)
        for p in (f"/usr/{m}", f"{REPO}/{m}", f"{actor.home}/{m}", f"/tmp/{m}", f"/run/lock/{m}", f"/var/tmp/{m}",
                  f"/dev/shm/{m}", f"/dev/shm/{m}-posix"):
            Path(p).unlink(missing_ok=True)
        for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]:
            if int(line.split()[0]) == shm_key:
                subprocess.run(["ipcrm", "-m", line.split()[1]], capture_output=True)
        host_marker.unlink(missing_ok=True)
        shutil.rmtree(rundir, ignore_errors=True)
        shutil.rmtree(cachedir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def _result(attacked, name: str) -> dict:
    results, leftover, _ = attacked
    assert name in results, f"the runner (the trainer) did not survive to report {name}: {results}, {leftover}"
    return results[name]


def test_every_call_says_how_it_was_isolated(attacked):
    r = _result(attacked, "read")
    for word in ("no network, pid, ipc, mount and uts namespaces", "user namespace", "own /proc", "no host files"):
        assert word in r["isolation"], r


def test_killing_its_ancestors_group_or_everything_spares_the_trainer_and_the_engine(attacked):
    results, leftover, _ = attacked
    for name in ("kill_ancestors", "kill_group", "kill_all"):
        _result(attacked, name)
    assert results.get("runner_alive") and leftover["runner_code"] == 0, (results, leftover)
    assert leftover["engine_alive"], "the code killed the engine stand-in"
    assert results["kill_all"]["status"] == "ok" and "survived" in results["kill_all"]["text"]


def test_no_other_process_environ_is_readable(attacked):
    r = _result(attacked, "environ")
    assert SECRET not in r["text"], "the code read a secret of another process (or its own environment)"
    assert "VLLM_API_KEY" not in r["text"] and "HF_TOKEN" not in r["text"]


def test_the_engine_port_cannot_be_reached(attacked):
    r = _result(attacked, "connect")
    assert r["status"] == "error" and "CONNECTED" not in r["text"], r


def test_writes_outside_the_scratch_never_reach_the_host(attacked):
    _, leftover, m = attacked
    r = _result(attacked, "write")
    assert r["status"] == "ok" and f"wrote /tmp/{m}" in r["text"], r  # the private scratch is writable
    assert leftover["files"] == [], f"the code's files are on the host: {leftover['files']}"


def test_the_runs_files_the_cache_and_the_repository_are_not_readable(attacked):
    r = _result(attacked, "read")
    assert ANSWER not in r["text"] and "[project]" not in r["text"], r["text"]
    assert r["text"].count("refused") == 3, r["text"]


def test_shared_memory_dies_with_the_call(attacked):
    _, leftover, _ = attacked
    r = _result(attacked, "shm")
    assert r["status"] == "ok" and "posix" in r["text"] and "shmget -1" not in r["text"], r
    assert leftover["shm"] == [], f"a SysV segment outlived the call: {leftover['shm']}"
    assert leftover["files"] == [], leftover["files"]


def test_a_fork_loop_stops_at_the_process_limit(attacked):
    r = _result(attacked, "fork_loop")
    assert "forked" in r["text"] and int(r["text"].split("forked")[1]) < 8, r


def test_a_setsid_child_does_not_outlive_the_call(attacked):
    _, leftover, _ = attacked
    r = _result(attacked, "setsid_child")
    assert r["status"] == "ok" and "left a child" in r["text"], r
    assert leftover["sleepers"] == [], f"the detached child survived the call: {leftover['sleepers']}"


def test_unshare_mount_and_umount_change_nothing(attacked):
    _, _, m = attacked
    r = _result(attacked, "mount")
    assert "wrote /usr" not in r["text"] and f"{m}-host" not in r["text"], r["text"]
    assert not Path(f"/usr/{m}").exists()


@pytest.mark.parametrize("kind", ["root", "user"])
def test_kill_9_of_the_trainer_takes_the_call_down(kind):
    base = Path(tempfile.mkdtemp(prefix="mdapo-isolation-"))
    mark = _sleep_mark(uuid.uuid4().hex)
    try:
        actor = Actor(kind, base)
        code = f"import os, time\nif os.fork() == 0:\n    os.execv('/bin/sleep', ['sleep', '{mark}'])\ntime.sleep(60)\n"
        runner = actor.popen(["isolation_runner.py", actor.job({"attacks": {"sleep": code}})],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not _pids_with(mark.encode()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pids_with(mark.encode()), "the call never started"
        jail = f'"parent": {runner.pid}'.encode()
        assert _pids_with(jail), "no jail process found"
        runner.kill()
        runner.wait()
        deadline = time.monotonic() + 10
        while (_pids_with(mark.encode()) or _pids_with(jail)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pids_with(mark.encode()) and not _pids_with(jail), "the call outlived its trainer"
    finally:
        for pid in _pids_with(mark.encode()):
            os.kill(pid, signal.SIGKILL)
        for workdir in Path(tempfile.gettempdir()).glob("mdapo-tool-*"):  # the killed trainer's, left behind
            with contextlib.suppress(OSError):
                if mark in (workdir / "main.py").read_text():
                    shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def test_a_machine_without_namespaces_refuses_the_python_tool_at_config_time_unless_limits_only(tmp_path):
    """As root in a chroot without CAP_SYS_ADMIN no namespace can be made (the kernel refuses a user
    namespace in a chroot, and the others need the capability): `config validate` stops in one line
    naming tools.python.isolation, accepts limits_only, and the calls then say limits_only."""
    if os.geteuid() != 0:
        pytest.skip("making a machine without namespaces (chroot, no CAP_SYS_ADMIN) needs root")
    if not all(shutil.which(t) for t in ("unshare", "mount", "chroot", "setpriv")):
        pytest.skip("NOT TESTED: unshare, mount, chroot or setpriv (util-linux, coreutils) is missing")
    root = tmp_path / "root"
    root.mkdir()
    validate = ["-m", "megatron_dapo.cli", "config", "validate", "examples/tiny_tools_cpu.yaml",
                "tools.tools=[calculator,python]", f"trainer.output_dir={tmp_path / 'run'}"]
    calls = ["-c", "from megatron_dapo.tools.sandbox import SandboxLimits as L, run_python as run\n"
             "print([(r.status, r.isolation) for r in (run('print(1)'), run('print(1)', L(isolation='limits_only')))])"]

    def without_namespaces(args: list[str]) -> subprocess.CompletedProcess:
        inner = " ".join(map(shlex.quote, ["setpriv", "--bounding-set=-sys_admin", sys.executable, *args]))
        script = f"mount --rbind / {shlex.quote(str(root))} && exec chroot {shlex.quote(str(root))} sh -c " + \
            shlex.quote(f"cd {shlex.quote(str(REPO))} && exec {inner}")
        return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO)})

    refused = without_namespaces(validate)
    lines = refused.stderr.strip().splitlines() + refused.stdout.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, (refused.returncode, lines)
    assert "tools.python.isolation=namespaces" in lines[0] and "limits_only" in lines[0], lines[0]
    accepted = without_namespaces([*validate, "tools.python.isolation=limits_only"])
    assert accepted.returncode == 0, accepted.stderr
    ran = without_namespaces(calls)
    (jailed, jail_says), (limited, limits_say) = eval(ran.stdout.strip().splitlines()[-1])
    assert jailed == "failed" and jail_says == "", "a call asked for namespaces ran without them"
    assert limited == "ok" and limits_say.startswith("limits_only"), ran.stdout


@pytest.mark.parametrize("kind", ["root", "user"])
def test_an_interpreter_in_a_venv_under_tmp_runs_behind_the_private_tmp(kind):
    # The jail's /tmp is its own scratch: the venv is bound read-only onto it at its own path.
    base = Path(tempfile.mkdtemp(prefix="mdapo-isolation-"))
    try:
        actor = Actor(kind, base)
        venv = base / "venv"
        venv.mkdir()
        actor.own(venv)
        made = actor.popen(["-m", "venv", "--without-pip", str(venv)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        assert made.wait(timeout=120) == 0, made.stdout.read()
        actor.python = str(venv / "bin" / "python")
        code = "import sys\nprint(sys.prefix)\nopen(sys.prefix + '/planted.py', 'w')\n"  # its owner's, read-only here
        runner = actor.popen(["isolation_runner.py", actor.job({"attacks": {"venv": code}})], stdout=subprocess.PIPE,
                             text=True)
        out, _ = runner.communicate(timeout=120)
        r = json.loads(out.splitlines()[0])["venv"]
        assert r["text"].startswith(f"{venv}\n") and "Read-only file system" in r["text"], r
    finally:
        shutil.rmtree(base, ignore_errors=True)
