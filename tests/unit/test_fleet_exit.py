"""A controller that fails mid-sync exits (rollout/fleet/broadcast.py: DaemonCalls).

Its servers wait in the group's rendezvous for it, its calls wait for them: with the calls on a
ThreadPoolExecutor the interpreter's exit joined them, so the failed trainer stayed alive (its
traceback printed) until the servers' deadline, 10 minutes by default, and its servers with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from megatron_dapo.faults import FAULT_ENV

SCRIPT = textwrap.dedent("""
    import threading
    import torch
    from megatron_dapo.rollout.fleet.broadcast import WeightBroadcast

    class WaitingServer:  # joins the group when its controller does: never, here
        name = "server0"
        tp_size = 1

        def init_weight_update_group(self, **kwargs):
            threading.Event().wait()

        def health(self):
            return True

    fleet = WeightBroadcast([WaitingServer()], master_address="127.0.0.1", timeout_s=600)
    fleet.update_weights([("w", torch.zeros(4))])
""")


def test_a_controller_failing_while_its_servers_join_exits_at_once() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                          env={**os.environ, FAULT_ENV: "fleet_init:0"})
    assert done.returncode == 1, done.stderr[-2000:]
    assert "injected fault at the start of fleet_init" in done.stderr
