"""The weights a restarted engine is loaded with, and the sync that is still bringing the next ones.

The RolloutController (controller_sync.py) replaces a dead or hung engine in place and loads it with
the weights of the last finished sync, with their version. It keeps them here, on the host: one
copy of the HF tensors, only when a restart is possible (``keep``). A sync arrives in pieces (a
bucket per call, a finish at the end, each call on its own, some from the sync's pool threads);
the buckets of the sync in progress become the kept weights only at its finish.

A restart must not land inside a sync. Between two buckets, or between the last bucket and the
finish, it would load the last sync's weights and version, and the rest of this sync would reach
the fresh engine only in part, its finish not at all (seen 2026-11-29: a SLURM vLLM server
restarted so served version 2's batches labelled 1, a StalenessError two steps later). So a sync
is marked from its first piece to its finish (``begin``/``finish``) and a restart waits for the
mark to clear (``wait_for_sync``). The lock is held by each piece and by a restart, and by a
per-stage sync for its whole length (fleet/stages.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

__all__ = ["KeptWeights"]

Bucket = list[tuple[str, torch.Tensor]]


class KeptWeights:
    """The last finished sync's weights on the host, and whether a sync is in progress."""

    def __init__(self, keep: bool) -> None:
        """Args:
            keep: whether weights are kept at all (an engine may restart: rollout.max_engine_restarts > 0).
        """
        self.keep = keep
        self.lock = threading.RLock()
        """Held by each piece of a sync and by a restart (a restart and a piece never interleave)."""
        self.buckets: list[Bucket] = []
        """The last finished sync's buckets: what a restarted engine loads."""
        self.version: int | None = None
        """Their version."""
        self.adapter: tuple[str, int] | None = None
        """An adapter-only sync's last adapter (directory, version): what a restarted engine loads
        on the base it starts from (rollout.lora_sync=adapter)."""
        self._incoming: list[Bucket] = []
        self._syncing = False
        self._sync_done = threading.Condition(self.lock)

    @property
    def syncing(self) -> bool:
        """Whether a sync is in progress (its first piece arrived, its finish not yet)."""
        return self._syncing

    def begin(self) -> None:
        """A piece of a sync arrives (call under the lock): a restart waits until its finish."""
        self._syncing = True

    def add(self, bucket: Sequence[tuple[str, torch.Tensor]], *, copy: bool = True) -> None:
        """Keep a bucket of the sync in progress, on the host.

        Args:
            copy: copy even host tensors (the caller's, which change with the next update);
                False for a buffer of the controller's own (moved to the host when on a GPU).
        """
        if self.keep:
            self._incoming.append([(n, t.detach().to("cpu", copy=copy)) for n, t in bucket])

    def finish(self, version: int | None) -> None:
        """The sync ended (call under the lock): its buckets become the kept weights, restarts go on."""
        if self.keep:
            self.buckets, self._incoming, self.version = self._incoming, [], version
        self._syncing = False
        self._sync_done.notify_all()

    def wait_for_sync(self, closing: threading.Event) -> None:
        """Wait (holding the lock) until no sync is in progress, or until `closing` is set."""
        while self._syncing and not closing.is_set():
            self._sync_done.wait(timeout=1.0)
