"""What another local user of the node can do to a running engine server (tests only).

docs/DESIGN.md, "What another user of the node can do to a run": without the key no route that
changes weights or state answers, and the key is in no process's command line.
"""

from __future__ import annotations

import json
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path


def status_without_key(base_url: str, path: str, method: str = "POST") -> int:
    """The HTTP status of a request that carries no Authorization header."""
    data = json.dumps({}).encode() if method == "POST" else None
    request = urllib.request.Request(base_url.rstrip("/") + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def command_lines_holding(secret: str) -> list[str]:
    """Every process command line on this machine that contains `secret` (what `ps -ef` shows)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if secret in text:
            found.append(f"{pid}: {text[:200]}")
    return found


def owner_only(path: str | Path) -> bool:
    """Whether only the owner may read the file (group and others have no bits)."""
    return stat.S_IMODE(Path(path).stat().st_mode) & 0o077 == 0
