"""The control plane on 4 gloo ranks: who leads each data-parallel replica, and that the
controller's per-DP shares reach exactly the ranks of that replica (TP and PP peers the same)."""

from __future__ import annotations

import os

import pytest
from dist_utils import run_distributed

pytestmark = pytest.mark.multirank


def _worker() -> dict:
    from megatron_dapo import parallel

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    out = {}
    for tp, pp in ((2, 1), (1, 2), (1, 1)):
        dims = parallel.initialize_model_parallel(tp, pp, seed=0)
        control = parallel.build_control_groups(dims, timeout_minutes=1)
        shares = [{"dp": d, "rows": list(range(d * 10, d * 10 + 3))} for d in range(dims.dp)] if dims.rank == 0 else None
        got = parallel.scatter_to_replicas(shares, control)
        out[f"tp{tp}pp{pp}"] = {"dp_rank": dims.dp_rank, "share": got, "leader": control.leaders is not None,
                                "leader_ranks": list(control.leader_ranks), "replica_src": control.replica_src}
    return out


def test_each_replica_receives_its_own_share_from_the_controller() -> None:
    results = run_distributed(_worker, 4, timeout_s=120)
    for layout, replica_size in (("tp2pp1", 2), ("tp1pp2", 2), ("tp1pp1", 1)):
        runs = [r[layout] for r in results]
        for rank, run in enumerate(runs):
            assert run["share"]["dp"] == run["dp_rank"]
            assert run["share"]["rows"] == [run["dp_rank"] * 10 + i for i in range(3)]
            assert run["leader"] == (rank in run["leader_ranks"])
            assert runs[run["replica_src"]]["dp_rank"] == run["dp_rank"]
        assert runs[0]["leader_ranks"][0] == 0
        assert len(runs[0]["leader_ranks"]) == 4 // replica_size
