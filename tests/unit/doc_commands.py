"""The shell lines of README.md and the user guide (docs/index.md, docs/guide/*.md), read out of
their fenced blocks, and a runner for the cheap ones (test_docs_build.py runs them).

Cheap: `megatron-dapo ... --help`, `megatron-dapo config show|validate|explain`, `megatron-dapo
plan`, `python tools/X.py --help` and `DRY_RUN=1 ... bash slurm/...`: seconds each, no training,
no GPU. `megatron-dapo` lines run in this process (`cli.run`), the rest under bash.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    lines: tuple[str, ...]


def blocks(pages: list[Path] = PAGES) -> list[Block]:
    """Every fenced block of the pages, with backslash continuations joined."""
    out = []
    for page in pages:
        text = page.read_text().splitlines()
        i = 0
        while i < len(text):
            m = FENCE.match(text[i].strip())
            if not m or not m.group(1):
                i += 1
                continue
            start, body = i, []
            i += 1
            while i < len(text) and text[i].strip() != "```":
                body.append(text[i])
                i += 1
            joined: list[str] = []
            for raw in body:
                if joined and joined[-1].endswith("\\"):
                    joined[-1] = joined[-1][:-1] + " " + raw.strip()
                else:
                    joined.append(raw)
            out.append(Block(page, start + 1, m.group(1), tuple(joined)))
            i += 1
    return out


def words(line: str) -> list[str]:
    """The line's words with its trailing comment gone."""
    return shlex.split(line, comments=True)


def is_cheap(argv: list[str]) -> bool:
    if not argv:
        return False
    if argv[0] == "megatron-dapo":
        rest = argv[1:]
        return ("--help" in rest or "--version" in rest or rest[:1] in (["plan"], ["doctor"])
                or rest[:2] in (["config", "show"], ["config", "validate"], ["config", "explain"]))
    if argv[0] in ("python", "python3"):
        return len(argv) > 1 and argv[1].startswith("tools/") and "--help" in argv
    env = [w for w in argv if "=" in w and not w.startswith("-")]
    return "DRY_RUN=1" in env and "bash" in argv and any(w.startswith("slurm/") for w in argv)


def shell_commands() -> list[tuple[str, str]]:
    """(where, line) of every cheap line in a bash/sh block."""
    out = []
    for b in blocks():
        if b.lang not in ("bash", "sh", "shell"):
            continue
        for k, line in enumerate(b.lines):
            if is_cheap(words(line)):
                out.append((f"{b.page.relative_to(ROOT)}:{b.line + 1 + k}", line.strip()))
    return out


def transcripts() -> list[tuple[str, str, list[str]]]:
    """(where, command, the output lines shown) of every `text` block that opens with `$ command`."""
    out = []
    for b in blocks():
        if b.lang == "text" and b.lines and b.lines[0].startswith("$ "):
            shown = [ln.rstrip() for ln in b.lines[1:] if ln.strip() and ln.strip() != "..."]
            out.append((f"{b.page.relative_to(ROOT)}:{b.line}", b.lines[0][2:].strip(), shown))
    return out


def run(line: str) -> tuple[int, str]:
    """Run one doc line from the repository root: (exit code, stdout + stderr)."""
    argv = words(line)
    if argv[0] == "megatron-dapo":
        from megatron_dapo import cli

        buf = io.StringIO()
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                try:
                    code = cli.run(argv[1:])
                except SystemExit as e:  # --help, argparse errors
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        finally:
            os.chdir(cwd)
        return code, buf.getvalue()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "MASTER_"))}
    env["PYTHON"] = sys.executable
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    script = re.sub(r"(^|\s)python3?\s", rf"\1{shlex.quote(sys.executable)} ", line, count=1)
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr
