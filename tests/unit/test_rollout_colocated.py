"""Colocated engine placement on CPU: who leads, which GPUs, the per-engine groups, the errors."""

import pytest
import torch

from megatron_dapo.rollout.sglang.colocated import plan_placement, ranks_per_node_from_env, serialize_cuda_ipc


def test_flagship_16_nodes_x_8_gpus_at_rollout_tp_8_and_4() -> None:
    p = plan_placement(world_size=128, gpus_per_node=8, engine_tp=8)
    assert (p.num_nodes, p.engines_per_node, p.num_engines) == (16, 1, 16)
    assert [p.slot(e).leader_rank for e in range(16)] == list(range(0, 128, 8))
    assert {p.slot(e).base_gpu_id for e in range(16)} == {0}
    assert p.slot(15).node == 15 and p.slot(15).ranks == tuple(range(120, 128))

    p = plan_placement(world_size=128, gpus_per_node=8, engine_tp=4)
    assert (p.engines_per_node, p.num_engines) == (2, 32)
    slots = [p.slot(e) for e in range(32)]
    assert [s.leader_rank for s in slots[:4]] == [0, 4, 8, 12]
    assert [s.base_gpu_id for s in slots[:4]] == [0, 4, 0, 4]
    assert [s.node for s in slots[:4]] == [0, 0, 1, 1]
    assert [s.name for s in slots[:3]] == ["sglang0", "sglang1", "sglang2"]


def test_every_rank_belongs_to_exactly_one_engine_at_its_tp_rank() -> None:
    p = plan_placement(world_size=16, gpus_per_node=8, engine_tp=2)
    groups = p.group_ranks()
    assert groups == [[2 * e, 2 * e + 1] for e in range(8)]
    assert sorted(r for g in groups for r in g) == list(range(16))
    leaders = [r for r in range(16) if p.is_leader(r)]
    assert leaders == [0, 2, 4, 6, 8, 10, 12, 14]
    for rank in range(16):
        slot = p.slot(p.engine_of(rank))
        # The engine's TP worker on this rank's GPU: base_gpu_id + tp rank == local rank.
        assert slot.ranks[p.tp_rank_of(rank)] == rank
        assert slot.base_gpu_id + p.tp_rank_of(rank) == rank % 8
        assert slot.node == rank // 8


def test_one_process_job_is_one_engine() -> None:
    p = plan_placement(world_size=1, gpus_per_node=1, engine_tp=1)
    assert (p.num_engines, p.group_ranks(), p.slot(0).base_gpu_id) == (1, [[0]], 0)


@pytest.mark.parametrize("tp", [3, 16])
def test_rollout_tp_that_does_not_divide_the_node_is_one_line_with_the_fix(tp: int) -> None:
    with pytest.raises(ValueError) as info:
        plan_placement(world_size=16, gpus_per_node=8, engine_tp=tp)
    message = str(info.value)
    assert "\n" not in message
    assert f"rollout.tensor_model_parallel_size={tp}" in message
    assert "8 GPUs per node" in message and "one of 1, 2, 4, 8" in message


def test_world_size_not_a_multiple_of_the_node_size() -> None:
    with pytest.raises(ValueError, match=r"world size 12 is not a multiple of 8 ranks per node"):
        plan_placement(world_size=12, gpus_per_node=8, engine_tp=1)


def test_ranks_per_node_from_torchrun_then_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    assert ranks_per_node_from_env(1) == 1
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE.*SLURM_NTASKS_PER_NODE"):
        ranks_per_node_from_env(16)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x16)")
    assert ranks_per_node_from_env(128) == 8
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8,4")
    with pytest.raises(ValueError, match="same number of ranks on every node"):
        ranks_per_node_from_env(12)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node_from_env(8) == 4


def test_cuda_ipc_serializer_rejects_cpu_tensors_before_importing_sglang() -> None:
    with pytest.raises(ValueError, match=r"'w' is on cpu; CUDA IPC needs the export on this rank's GPU"):
        serialize_cuda_ipc([("w", torch.zeros(2))])
