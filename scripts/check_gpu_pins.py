"""Check that constraints/gpu.txt is one installable set, from package metadata alone.

`pip install -e .[gpu] -c constraints/gpu.txt` on a cluster downloads several GB (torch,
sglang-kernel, flashinfer, TE); a pin that contradicts another package's Requires-Dist only
shows up there, after the download. This check reads the metadata of every pinned
distribution from the package index without downloading a wheel:

- PEP 658 `<wheel>.metadata` when the index serves it (pypi.org does);
- otherwise the wheel's METADATA member read through HTTP range requests (the zip's
  central directory is at the end of the file: a few hundred KB, not the whole wheel);
- for a package published only as an sdist (transformer_engine_torch), its PKG-INFO.

Then, for the target (CPython 3.12 by default, Linux x86_64, glibc 2.34), it checks:
every pin has a file installable there; every Requires-Dist of a pinned package (markers
and the extras we request evaluated) that names another pinned package admits that pin;
and setup.py's install_requires and `gpu` extra admit the pins (seconds). Then pip's own
resolver runs over the whole tree (`install --dry-run --report --only-binary=:all:` for the
target platform, fast-deps for indexes without PEP 658; 1-2 minutes with pip >= 25), so an
unpinned transitive dependency that cannot be satisfied fails too. Any failure is one line
naming the packages and versions. Exit 0 when consistent, 1 on a conflict, 3 when the index
cannot be reached (CI has PyPI access; a sandbox may not).

    python3 scripts/check_gpu_pins.py [--python 3.12] [--constraints constraints/gpu.txt] [--no-resolve]
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
INDEX = "https://pypi.org/simple"
# Newer sglang wheels are manylinux_2_34; pip treats every lower glibc tag as compatible.
GLIBC = (2, 34)


@dataclass(kw_only=True, slots=True)
class Pin:
    """One `name==version[; marker]` line of a constraints file, with the extras we install."""

    name: str
    """Canonical project name."""
    version: Version
    """The exact version pinned."""
    extras: frozenset[str] = field(default_factory=frozenset)
    """Extras requested from it by setup.py (e.g. transformer-engine[pytorch,core_cu13])."""


def read_pins(path: Path) -> dict[str, Pin]:
    """Parses exact pins (`name==X`); anything else in a constraints file is an error here.

    Returns:
        canonical name -> Pin.
    """
    pins: dict[str, Pin] = {}
    for num, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            raise SystemExit(f"{path}:{num}: '{line}' is not an exact pin; write name==version")
        pins[canonicalize_name(req.name)] = Pin(name=canonicalize_name(req.name), version=Version(specs[0].version))
    return pins


def setup_requirements(setup_py: Path, extra: str) -> list[Requirement]:
    """install_requires plus one extra from setup.py, read as literals (nothing is run)."""
    tree = ast.parse(setup_py.read_text(encoding="utf-8"))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    reqs = list(ast.literal_eval(kw["install_requires"]))
    reqs += ast.literal_eval(kw["extras_require"])[extra]
    return [Requirement(r) for r in reqs]


def target_env(python: str) -> dict[str, str]:
    """The marker environment of a Linux x86_64 CPython `python` (e.g. "3.12")."""
    env = default_environment()
    env.update(
        python_version=python,
        python_full_version=f"{python}.0",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
    )
    return env


def applies(req: Requirement, env: dict[str, str], extras: frozenset[str]) -> bool:
    """Whether a Requires-Dist line is active for `env` with `extras` requested."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))


def conflicts(
    requirer: str,
    requires: list[Requirement],
    pins: dict[str, Pin],
    env: dict[str, str],
    extras: frozenset[str] = frozenset(),
) -> list[str]:
    """One line per requirement of `requirer` that a pin violates (pure; the unit test's subject).

    Args:
        requirer: who declares `requires` ("setup.py" or "sglang==0.5.23").
        requires: its requirements (Requires-Dist or setup.py lines).
        pins: the constraints.
        env: target marker environment.
        extras: extras requested from `requirer`, for `extra == "..."` markers.
    Returns:
        e.g. ["sglang==0.5.23 requires torch==2.14.1 but the constraints pin torch==2.13.0"].
    """
    out = []
    for req in requires:
        pin = pins.get(canonicalize_name(req.name))
        if pin is None or not applies(req, env, extras):
            continue
        if not req.specifier.contains(pin.version, prereleases=True):
            out.append(
                f"{requirer} requires {req.name}{req.specifier} but the constraints pin {pin.name}=={pin.version}"
            )
    return out


# ---- reading metadata from the index, without downloading wheels ----


def _get(url: str, headers: dict[str, str] | None = None, timeout: float = 60.0) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "megatron-dapo-check-gpu-pins", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def _project_files(name: str) -> list[dict]:
    body = _get(f"{INDEX}/{name}/", {"Accept": "application/vnd.pypi.simple.v1+json"})
    return json.loads(body)["files"]


def _wheel_fits(filename: str, python: str) -> bool:
    """A wheel installable on CPython `python`, Linux x86_64, glibc <= GLIBC."""
    _, _, _, tags = parse_wheel_filename(filename)
    cp = "cp" + python.replace(".", "")
    return any(_tag_fits(t, cp, int(python.split(".")[1])) for t in tags)


def _tag_fits(tag: Tag, cp: str, minor: int) -> bool:
    if tag.interpreter.startswith("cp") and tag.abi == "abi3":
        interp_ok = int(tag.interpreter[3:] or 0) <= minor
    else:
        interp_ok = tag.interpreter in (cp, "py3", f"py3{minor}") and tag.abi in (cp, "none", "abi3")
    plat = tag.platform
    if plat == "any":
        return interp_ok
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", plat)
    if m:
        return interp_ok and (int(m[1]), int(m[2])) <= GLIBC
    legacy = {"manylinux1_x86_64": (2, 5), "manylinux2010_x86_64": (2, 12), "manylinux2014_x86_64": (2, 17)}
    return interp_ok and plat in legacy and legacy[plat] <= GLIBC


def _metadata_by_range(url: str) -> str:
    """METADATA of a remote wheel from its zip central directory, via HTTP range requests."""
    tail = _get(url, {"Range": "bytes=-65536"})
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise OSError(f"no zip end record in the last 64 KiB of {url}")
    cd_size, cd_offset = struct.unpack("<II", tail[eocd + 12 : eocd + 20])
    cd = _get(url, {"Range": f"bytes={cd_offset}-{cd_offset + cd_size - 1}"})
    pos = 0
    while pos < len(cd):
        (method, csize, name_len, extra_len, comment_len, local_off) = (
            struct.unpack("<H", cd[pos + 10 : pos + 12])[0],
            struct.unpack("<I", cd[pos + 20 : pos + 24])[0],
            *struct.unpack("<HHH", cd[pos + 28 : pos + 34]),
            struct.unpack("<I", cd[pos + 42 : pos + 46])[0],
        )
        name = cd[pos + 46 : pos + 46 + name_len].decode()
        pos += 46 + name_len + extra_len + comment_len
        if re.fullmatch(r"[^/]+\.dist-info/METADATA", name):
            # Local header (30 B + name + extra) precedes the data; read it with margin.
            blob = _get(url, {"Range": f"bytes={local_off}-{local_off + 30 + 1024 + csize}"})
            n, e = struct.unpack("<HH", blob[26:30])
            data = blob[30 + n + e : 30 + n + e + csize]
            return (zlib.decompress(data, -15) if method == 8 else data).decode()
    raise OSError(f"no .dist-info/METADATA in {url}")


def fetch_metadata(pin: Pin, python: str) -> tuple[str, str]:
    """(metadata text, file it came from) for `pin` on the target; raises LookupError if none fits."""
    files = [f for f in _project_files(pin.name) if not f.get("yanked")]
    wheels, sdists = [], []
    for f in files:
        fn = f["filename"]
        try:
            if fn.endswith(".whl"):
                if parse_wheel_filename(fn)[1] == pin.version and _wheel_fits(fn, python):
                    wheels.append(f)
            elif fn.endswith(".tar.gz") and Version(fn[:-7].rsplit("-", 1)[1]) == pin.version:
                sdists.append(f)
        except ValueError:
            continue
    if wheels:
        f = wheels[0]
        if f.get("core-metadata") or f.get("data-dist-info-metadata"):
            return _get(f["url"] + ".metadata").decode(), f["filename"]
        return _metadata_by_range(f["url"]), f["filename"]
    if sdists:
        # sdist-only (transformer_engine_torch builds against the installed torch): PKG-INFO.
        raw = _get(sdists[0]["url"])
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            member = next(m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
            return tar.extractfile(member).read().decode(), sdists[0]["filename"]
    raise LookupError(f"no file of {pin.name}=={pin.version} installs on CPython {python} manylinux x86_64")


def check(constraints: Path, python: str) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """Pin-against-pin conflicts of `constraints` for CPython `python` (network).

    Returns:
        (one line per conflict, canonical name -> (metadata text, file it was read from)).
    """
    pins = read_pins(constraints)
    env = target_env(python)
    problems = []
    setup_reqs = setup_requirements(ROOT / "setup.py", "gpu")
    for req in setup_reqs:
        if canonicalize_name(req.name) in pins:
            pins[canonicalize_name(req.name)].extras = frozenset(req.extras)
    problems += conflicts("setup.py", setup_reqs, pins, env)

    metas: dict[str, tuple[str, str]] = {}

    def one(pin: Pin) -> list[str]:
        try:
            text, filename = fetch_metadata(pin, python)
        except LookupError as exc:
            return [str(exc)]
        metas[pin.name] = (text, filename)
        meta = HeaderParser().parsestr(text)
        rp = meta.get("Requires-Python")
        out = []
        if rp and not Requirement(f"x{rp}").specifier.contains(f"{python}.0"):
            out.append(f"{pin.name}=={pin.version} ({filename}) needs Python {rp}, not {python}")
        reqs = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
        return out + conflicts(f"{pin.name}=={pin.version}", reqs, pins, env, pin.extras)

    with ThreadPoolExecutor(8) as pool:
        for found in pool.map(one, pins.values()):
            problems += found
    return problems, metas


def resolve_requirements(metas: dict[str, tuple[str, str]], python: str) -> list[str]:
    """What pip resolves: setup.py's requirements, with every sdist-only pin replaced by its
    own Requires-Dist (pip would build it, which needs torch: the multi-GB download).

    For transformer-engine[pytorch] that is transformer-engine plus transformer_engine_torch's
    requirements (torch, transformer_engine_cu13, onnx, ...).
    """
    env = target_env(python)
    sdist_only = {n for n, (_, fn) in metas.items() if fn.endswith(".tar.gz")}
    out: list[str] = []
    for req in setup_requirements(ROOT / "setup.py", "gpu"):
        name = canonicalize_name(req.name)
        if name in metas and req.extras:
            meta = HeaderParser().parsestr(metas[name][0])
            keep = set()
            for extra in req.extras:
                pulled = {
                    canonicalize_name(Requirement(r).name)
                    for r in meta.get_all("Requires-Dist") or []
                    if applies(Requirement(r), env, frozenset({extra}))
                    and not applies(Requirement(r), env, frozenset())
                }
                if not pulled & sdist_only:
                    keep.add(extra)
            req.extras = keep
        out.append(str(req))
    cuda_variant = {re.sub(r"-cu\d+$", "", n): n for n in metas if re.search(r"-cu\d+$", n)}
    for name in sorted(sdist_only):
        meta = HeaderParser().parsestr(metas[name][0])
        for line in meta.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if not applies(req, env, frozenset()):
                continue
            # An sdist's requirements were written on the machine that built it: TE's torch
            # extension asks for the TE core of *torch's* CUDA major (transformer_engine_cu12
            # in the 2.11.0 sdist); the constraints name the one for the pinned torch.
            base = re.sub(r"-cu\d+$", "", canonicalize_name(req.name))
            if canonicalize_name(req.name) not in metas and base in cuda_variant:
                req.name = cuda_variant[base]
            out.append(str(req))
    return out


def pip_resolve(requirements: list[str], python: str, pins: dict[str, Pin], sdist_only: set[str]) -> list[str]:
    """Runs pip's resolver (--dry-run) over the whole dependency tree for the target.

    pip reads PEP 658 metadata where the index serves it and, with fast-deps, range-reads
    the wheel otherwise, so no wheel is downloaded whole.

    Returns:
        [] when pip finds a solution, else one line with pip's own explanation.
    """
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(GLIBC[1], 16, -1)]
    platforms += ["manylinux2014_x86_64", "linux_x86_64"]
    with tempfile.TemporaryDirectory() as tmp:
        cons = Path(tmp) / "constraints.txt"
        # pip would have to build an sdist-only pin; its requirements are already in the list.
        cons.write_text(
            "".join(
                f"{p.name}=={p.version}\n" for p in pins.values() if p.name not in sdist_only
            )
        )
        cmd = [
            sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
            "--use-feature=fast-deps", "--no-cache-dir", "--only-binary=:all:",
            "--python-version", python, "--implementation", "cp", "--abi", "cp" + python.replace(".", ""),
            *[a for plat in platforms for a in ("--platform", plat)],
            "--target", str(Path(tmp) / "target"), "--report", str(Path(tmp) / "report.json"),
            "-c", str(cons), *requirements,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode == 0:
            report = json.loads((Path(tmp) / "report.json").read_text())
            got = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
            return [
                f"pip resolved {n}=={got[n]}, not the pinned {p.version}"
                for n, p in pins.items()
                if n in got and Version(got[n]) != p.version
            ]
    # pip prints the ERROR lines on stderr and "The conflict is caused by:" on stdout.
    text = proc.stdout + "\n" + proc.stderr
    err = [ln.strip() for ln in text.splitlines() if ln.strip() and "Location" not in ln]
    if any(k in text for k in ("NewConnectionError", "Temporary failure in name resolution")):
        raise ConnectionError(err[-1] if err else "pip could not reach the index")
    why = [ln for ln in err if ln.startswith(("ERROR: Cannot install", "ERROR: Could not find", "ERROR: No matching"))]
    why += [ln for ln in err if ln.startswith("The user requested") or " depends on " in ln]
    return ["pip cannot resolve the set: " + " | ".join(why or err[-3:])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--constraints", type=Path, default=ROOT / "constraints" / "gpu.txt")
    ap.add_argument("--python", default="3.12", help="target CPython minor version")
    ap.add_argument("--no-resolve", action="store_true",
                    help="only pin against pin (seconds); skip pip's resolve of the whole tree (1-2 min)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    try:
        problems, metas = check(args.constraints, args.python)
        if not problems and not args.no_resolve:
            pins = read_pins(args.constraints)
            sdist_only = {n for n, (_, fn) in metas.items() if fn.endswith(".tar.gz")}
            problems = pip_resolve(resolve_requirements(metas, args.python), args.python, pins, sdist_only)
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        print(f"check_gpu_pins: cannot reach the package index {INDEX} ({exc}); this check needs network access")
        return 3
    took = time.monotonic() - start
    for p in problems:
        print(f"check_gpu_pins: {p}")
    if problems:
        return 1
    print(f"check_gpu_pins: {args.constraints.name} is consistent for CPython {args.python} x86_64 ({took:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
