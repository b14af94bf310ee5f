"""Who a failed fleet broadcast names (rollout/fleet/broadcast.py ``_raise``).

A broadcast whose source is another rank (a pipeline stage's first rank, fleet/stages.py) that
dies mid-bucket leaves every other member with gloo's "Connection reset by peer": the
controller's own receive and each server's answer (HTTP 400 quoting it). The line must name the
source, not the first server that echoed it; a server that died, or one that failed for a reason
of its own, is still named as before. Here the group and the servers are stand-ins; the same
failure with a real SGLang server and a SIGKILLed rank is tests/sglang_cpu/test_sglang_fleet.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.rollout.fleet.broadcast import FleetSyncError, WeightBroadcast

RESET = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4242: Connection reset by peer"


class _Process:
    def __init__(self, dead: bool, dies_after_s: float | None = None) -> None:
        self.dead = dead
        self.dies_at = None if dies_after_s is None else time.monotonic() + dies_after_s

    def check_alive(self) -> None:
        if self.dead or (self.dies_at is not None and time.monotonic() >= self.dies_at):
            raise EngineError("exited with -9")


class _Server:
    tp_size = 1

    def __init__(self, name: str, answer: str | None, dead: bool = False, dies_after_s: float | None = None) -> None:
        self.name, self.answer, self.process = name, answer, _Process(dead, dies_after_s)

    def receive_distributed(self, bucket, **kwargs) -> None:
        if self.answer is not None:
            raise EngineError(f"SGLang engine {self.name}: POST /update_weights_from_distributed failed with HTTP 400: "
                              f"Failed to update parameter online: {self.answer}")


class _Work:
    def __init__(self, error: str | None) -> None:
        self.error = error

    def wait(self) -> None:
        if self.error is not None:
            raise RuntimeError(self.error)


class _Group:
    def __init__(self, error: str | None) -> None:
        self.error = error

    def broadcast(self, tensors, options) -> _Work:
        return _Work(self.error)


def _carry(servers: list[_Server], own_error: str | None, source: str | None) -> str:
    fleet = WeightBroadcast(servers, master_address="127.0.0.1", timeout_s=5)
    fleet.exit_grace_s = 1.0  # 10 s in a run: a server whose worker died takes a few to exit
    bucket = [("w", torch.empty(4, device="meta"))]
    with pytest.raises(FleetSyncError) as failed:
        fleet._carry(_Group(own_error), "g", bucket, lambda: torch.empty(16, dtype=torch.uint8),
                     "pipeline stage 1's broadcast", source=source)
    return str(failed.value)


@pytest.mark.parametrize("own_error", [RESET, None], ids=["controller-reset", "controller-got-its-bytes"])
def test_a_gone_source_is_named_not_the_servers_that_echo_it(own_error) -> None:
    message = _carry([_Server("sglang0", RESET), _Server("sglang1", RESET)], own_error, "pipeline stage 1's first rank")
    assert message.startswith("weight broadcast to the fleet failed at pipeline stage 1's broadcast: pipeline stage 1's "
                              "first rank is gone (the broadcast's other members saw \"Connection reset by peer\")"), message


def test_a_dead_server_is_named_even_in_another_ranks_broadcast() -> None:
    message = _carry([_Server("sglang0", RESET), _Server("sglang1", RESET, dead=True)], RESET,
                     "pipeline stage 1's first rank")
    assert "sglang1 died" in message and "is gone" not in message, message


def test_a_server_whose_worker_died_is_named_once_it_exits() -> None:
    """Its worker gone, its main process lives on a moment and its answer quotes the reset as the
    others' do: it is named when it exits within the grace, not the source."""
    message = _carry([_Server("sglang0", RESET), _Server("sglang1", RESET, dies_after_s=0.3)], RESET,
                     "pipeline stage 1's first rank")
    assert "sglang1 died" in message and "is gone" not in message, message


def test_a_deadline_is_not_a_lost_source() -> None:
    message = _carry([_Server("sglang0", RESET)], "[gloo] Timed out waiting 600000ms for recv operation",
                     "pipeline stage 1's first rank")
    assert "is gone" not in message and "sglang0" in message, message


def test_a_server_failing_for_its_own_reason_is_named() -> None:
    message = _carry([_Server("sglang0", RESET), _Server("sglang1", "not enough memory")], None,
                     "pipeline stage 1's first rank")
    assert "is gone" not in message and "sglang1" in message, message


def test_the_controllers_own_broadcast_names_the_servers() -> None:
    message = _carry([_Server("sglang0", RESET)], RESET, None)
    assert "is gone" not in message and "sglang0: SGLang engine sglang0" in message, message


class _NcclGroup:
    """A stand-in for an NCCL group whose broadcast waits for every member, with no deadline of its
    own (as the first broadcast's communicator creation does): only shutdown() (an abort) ends it."""

    def __init__(self, completes: bool = False) -> None:
        import threading

        self.aborted, self.completes = threading.Event(), completes

    def broadcast(self, tensors, options) -> _Work:
        if not self.completes:
            self.aborted.wait(timeout=60)
            return _Work("NCCL communicator was aborted")
        return _Work(None)

    def shutdown(self) -> None:
        self.aborted.set()


def test_on_nccl_a_server_failing_before_it_joins_ends_the_broadcast_at_once() -> None:
    """Issue 41's "never a hang" on GPUs (a reading of the GPU path, 2026-11-29): a server that
    refuses the update never joins the broadcast, NCCL gives the controller's side no deadline,
    and gloo's would be timeout_s. The watched broadcast ends the sync when the request fails,
    names the server, and shuts the group down, which aborts the broadcast in flight."""
    fleet = WeightBroadcast([_Server("sglang0", None), _Server("sglang1", "not enough memory")],
                            master_address="127.0.0.1", backend="nccl", timeout_s=30, device="cpu")
    fleet.exit_grace_s = 0.5
    group = _NcclGroup()
    fleet._group = group
    start = time.monotonic()
    with pytest.raises(FleetSyncError, match=r"sglang1: .*not enough memory") as failed:
        fleet._carry(group, "g", [("w", torch.empty(4, device="meta"))], lambda: torch.empty(16, dtype=torch.uint8),
                     "the broadcast")
    assert time.monotonic() - start < 5, failed.value
    assert group.aborted.is_set(), "the group in flight was not shut down"
    assert "\n" not in str(failed.value)


def test_on_nccl_a_broadcast_nobody_fails_or_finishes_ends_at_the_deadline() -> None:
    fleet = WeightBroadcast([_Server("sglang0", None)], master_address="127.0.0.1", backend="nccl", timeout_s=1,
                            device="cpu")
    group = _NcclGroup()
    fleet._group = group
    with pytest.raises(FleetSyncError, match=r"the broadcast did not end within 1 s"):
        fleet._carry(group, "g", [("w", torch.empty(4, device="meta"))], lambda: torch.empty(16, dtype=torch.uint8),
                     "the broadcast")
    assert group.aborted.is_set()
    done = WeightBroadcast([_Server("sglang0", None)], master_address="127.0.0.1", backend="nccl", timeout_s=5,
                           device="cpu")
    flat = done._carry(_NcclGroup(completes=True), "g", [("w", torch.empty(4, device="meta"))],
                       lambda: torch.empty(16, dtype=torch.uint8), "the broadcast")
    assert flat.numel() == 16 and done.bytes_broadcast == 16
