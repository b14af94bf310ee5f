"""The validation primitives every config section uses.

Each section dataclass validates its own fields in __post_init__ with `_check`, which
raises `_FieldError(key, message)`; the YAML loader (loader.py) prefixes the dotted path
and the source, and turns it into the one-line `ConfigError` a user sees. This module
imports nothing of the project but errors.py, so every section module can import it.
"""

from __future__ import annotations

from megatron_dapo.errors import UserError


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
