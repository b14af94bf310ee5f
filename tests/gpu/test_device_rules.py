"""The device rules of DESIGN.md ("Where tensors live") on a real GPU with NCCL.

GPU tier: one process, world size 1, the default group "cpu:gloo,cuda:nccl". CPU control
tensors go over megatron's groups without error, the batch dispatch runs on CPU, and
step 5 mixes the engine's CPU log-probs with the actor's CUDA log-probs correctly.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def dims():
    from megatron_dapo import parallel

    env = parallel.init_distributed("cuda")
    assert env.backend == "cpu:gloo,cuda:nccl"
    yield parallel.initialize_model_parallel(1, 1, seed=0)


def test_cpu_and_cuda_tensors_share_megatron_groups(dims):
    for group in (dims.dp_group, dims.tp_group, dims.pp_group, dims.mp_group, None):
        cpu = torch.ones(3, dtype=torch.float64)
        cuda = torch.ones(3, device=dims.device)
        dist.all_reduce(cpu, group=group)
        dist.all_reduce(cuda, group=group)
        assert cpu.device.type == "cpu" and cuda.device.type == "cuda"


def test_dispatch_runs_on_cpu_groups(dims):
    from megatron_dapo import parallel

    control = parallel.build_control_groups(dims, 5)
    share = parallel.scatter_to_replicas([{"rows": [1, 2, 3]}], control)
    assert share == {"rows": [1, 2, 3]}


def test_old_log_probs_mix_cpu_rollout_and_cuda_actor(dims):
    from megatron_dapo.actor.microbatch import RolloutBatch
    from megatron_dapo.collect.shards import Shard
    from megatron_dapo.config import AlgorithmConfig
    from megatron_dapo.trainer import rollout_mismatch

    mask = torch.tensor([[False, True, True]])
    batch = RolloutBatch(input_ids=torch.zeros(1, 3, dtype=torch.long), seq_lens=torch.tensor([3]),
                         response_mask=mask, advantages=torch.zeros(1, 3))
    batch.old_log_probs = torch.tensor([[0.0, -1.0, -2.0]], device=dims.device)  # the actor's, on its GPU
    cfg = SimpleNamespace(rollout=SimpleNamespace(temperature=1.0), algorithm=AlgorithmConfig())
    run = SimpleNamespace(dims=dims, cfg=cfg)
    shard = Shard(batch=batch, rollout_log_probs=torch.tensor([[0.0, -1.5, -2.0]]))
    metrics = rollout_mismatch(run, [shard], correct=True)
    assert metrics["rollout/train_logprob_abs_diff"] == pytest.approx(0.25)
    assert batch.old_log_probs.device.type == "cuda" and batch.response_mask.device.type == "cpu"
