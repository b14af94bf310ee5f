"""The validation primitives every config section uses.

Each section dataclass validates its own fields in __post_init__ with `_check`, which
raises `_FieldError(key, message)`; the YAML loader (loader.py) prefixes the dotted path
and the source, and turns it into the one-line `ConfigError` a user sees. This module
imports nothing of the project but errors.py, so every section module can import it.
"""

from __future__ import annotations

import reprlib
from typing import Any

from megatron_dapo.errors import UserError

_SHOW = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHOW.maxlevel, _SHOW.maxdict, _SHOW.maxlist, _SHOW.maxtuple, _SHOW.maxset = 3, 6, 6, 6, 6
_SHOW.maxstring, _SHOW.maxlong, _SHOW.maxother = 80, 40, 80


def show(value: Any) -> str:
    """repr() bounded in length and depth: what error messages quote of a user's value (a list of
    99,000 aliases of one 600 KB string is 59 GB as a plain repr)."""
    return _SHOW.repr(value)


class ConfigError(UserError):
    """A user's configuration mistake. `str(err)` is one line: key, source, problem, fix."""


class _FieldError(ValueError):
    """Raised inside __post_init__; the loader adds the dotted path and the source."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise _FieldError(key, message)


NAME_MAX = 255
"""Bytes of one path component (Linux, and every file system a run writes to)."""
PATH_MAX = 4096
"""Bytes of a whole path (Linux)."""


def _check_path(path: str | None, key: str) -> None:
    """A path the file system can take: past NAME_MAX or PATH_MAX every open raises OSError
    ("File name too long"), as a traceback wherever the run first touches it."""
    if path is None:
        return
    size = len(path.encode("utf-8", "surrogatepass"))
    longest = max((len(part.encode("utf-8", "surrogatepass")) for part in path.split("/")), default=0)
    _check(size <= PATH_MAX and longest <= NAME_MAX, key,
           f"is a path of {size} bytes whose longest name is {longest} bytes; the file system takes at most "
           f"{PATH_MAX} bytes a path and {NAME_MAX} a name: give the path you meant")

