"""The one exception family for user mistakes (bad config, data, checkpoint or CLI input).

Entry points catch `UserError`, print its one-line message and exit with code 2; any other
exception is a bug and keeps its traceback.
"""

import argparse
import warnings


class UserError(ValueError):
    """A mistake the user can fix; `str(err)` names what is wrong, where, and the fix."""


class SharedUserError(UserError):
    """A UserError raised alike on every rank (the config, or one broadcast by the controller).

    Multi-process entry points print it on rank 0 only, so a 64-rank job shows it once.
    """


EXIT_USER_ERROR = 2

# What gloo/NCCL say when the other side of a collective is gone.
PEER_GONE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                     "remote process exited", "communicator was aborted")


def lost_peer(err: BaseException) -> bool:
    """Whether `err` is torch.distributed saying the other side of a collective is gone.

    Only torch.distributed's own errors count (gloo raises a plain RuntimeError, NCCL a
    DistError): an engine's or a reward's error may quote a "Connection reset by peer" of its
    own, and that is the root cause, not an echo.
    """
    from torch.distributed import DistError

    if type(err) is not RuntimeError and not isinstance(err, DistError):
        return False
    return lost_peer_marker(str(err)) is not None


def lost_peer_marker(text: str) -> str | None:
    """The words in `text` that say a collective lost its peer (a server's answer may quote its
    gloo error), or None."""
    return next((marker for marker in PEER_GONE_MARKERS if marker in text), None)


class CliParser(argparse.ArgumentParser):
    """argparse that exits 2 with a one-line message (its default is also 2, plus usage)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def quiet_optional_backend_warnings() -> None:
    """megatron-core warns on import that Transformer Engine / Apex are missing (always, on CPU):
    noise around the one line a user error prints."""
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
