"""The CPU compatibility layer and the parallel layout, on real megatron-core with gloo.

The CPU layer is process-global (a TorchFunctionMode), so even the single-process checks
run in a spawned rank: the pytest process itself must stay unpatched.

megatron_dapo.parallel is imported inside the functions so that the harness test's worker
starts without importing megatron.
"""

from __future__ import annotations

import threading

import pytest
import torch
from dist_utils import WorkerError, run_distributed

pytestmark = pytest.mark.multirank


def _cpu_layer_checks() -> dict[str, object]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_dapo import parallel
    from megatron_dapo.device import cpu_layer_active, setup_device

    device = setup_device("auto")
    again = setup_device("auto")
    dims = parallel.initialize_model_parallel(1, 1, seed=7)
    tracker = get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        forked = torch.rand(4)
    after = torch.get_rng_state()
    with tracker.fork():
        forked_next = torch.rand(4)
    in_thread: list[str] = []

    def make_tensor_in_thread() -> None:
        setup_device("auto")
        in_thread.append(str(torch.zeros(1, device="cuda").device))

    thread = threading.Thread(target=make_tensor_in_thread)
    thread.start()
    thread.join()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    torch.cuda.synchronize()
    return {
        "device": str(device),
        "same": again == device,
        "active": cpu_layer_active(),
        "factory": str(torch.empty(3, device="cuda").device),
        "index": str(torch.zeros(2, device=torch.cuda.current_device()).device),
        "cuda_method": str(torch.ones(2).cuda().device),
        "to_cuda": str(torch.ones(2).to("cuda", torch.float16).device),
        "type_names": (torch.ones(1).type(), torch.ones(1, dtype=torch.bfloat16).type()),
        "type_cast": torch.ones(1).type(torch.float64).dtype,
        "rng_restored": torch.equal(before, after),
        "fork_advances": not torch.equal(forked, forked_next),
        "elapsed": event.elapsed_time(event),
        "backend": torch.distributed.get_backend(),
        "is_controller": dims.is_controller,
        "in_thread": in_thread,
    }


def test_cpu_layer_maps_cuda_to_cpu_and_forks_rng() -> None:
    (result,) = run_distributed(_cpu_layer_checks, 1)
    assert result == {
        "device": "cpu",
        "same": True,
        "active": True,
        "factory": "cpu",
        "index": "cpu",
        "cuda_method": "cpu",
        "to_cuda": "cpu",
        "type_names": ("torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor"),
        "type_cast": torch.float64,
        "rng_restored": True,
        "fork_advances": True,
        "elapsed": 0.0,
        "backend": "gloo",
        "is_controller": True,
        "in_thread": ["cpu"],
    }


def _train_step_tp2_pp2() -> dict[str, object]:
    """GPTModel (local spec) + DDP + distributed optimizer, one step through the PP schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.transformer import TransformerConfig

    from megatron_dapo import parallel

    dims = parallel.initialize_model_parallel(2, 2, seed=3, num_attention_heads=4, num_layers=2)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.1,
        attention_dropout=0.0,
    )
    with get_cuda_rng_tracker().fork():
        tp_stream = torch.rand(1).item()
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
        pre_process=dims.is_first_stage,
        post_process=dims.is_last_stage,
    )
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [model]
    )
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.arange(16).view(2, 8) % 64
    positions = torch.arange(8).expand(2, 8)

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        output = chunk(tokens, positions, None, labels=tokens)

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([0, 1]),
        model=[model],
        num_microbatches=2,
        seq_length=8,
        micro_batch_size=2,
        forward_only=False,
    )
    update_ok, grad_norm, _ = optimizer.step()
    changed = sum(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    return {
        "ranks": (dims.tp_rank, dims.pp_rank, dims.dp_rank, dims.dp),
        "first_last": (dims.is_first_stage, dims.is_last_stage),
        "pp_global_ranks": dims.pp_global_ranks,
        "has_embedding_group": dims.embedding_group is not None,
        "num_losses": len(losses),
        "update_ok": update_ok,
        "grad_norm_positive": grad_norm is not None and grad_norm > 0,
        "all_params_changed": changed == len(before),
        "tp_stream": tp_stream,
    }


def test_tp2_pp2_train_step_on_cpu() -> None:
    results = run_distributed(_train_step_tp2_pp2, 4)
    assert [r["ranks"] for r in results] == [(0, 0, 0, 1), (1, 0, 0, 1), (0, 1, 0, 1), (1, 1, 0, 1)]
    assert [r["first_last"] for r in results] == [(True, False), (True, False), (False, True), (False, True)]
    assert [r["pp_global_ranks"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert all(r["has_embedding_group"] for r in results)
    assert [r["num_losses"] for r in results] == [0, 0, 2, 2]
    assert all(r["update_ok"] and r["grad_norm_positive"] and r["all_params_changed"] for r in results)
    # The tracker's TP stream differs across TP ranks and is identical across stages.
    streams = [r["tp_stream"] for r in results]
    assert streams[0] == streams[2] and streams[1] == streams[3] and streams[0] != streams[1]


def _raise_value_error(message: str) -> None:
    raise ValueError(message)


def test_run_distributed_propagates_worker_traceback() -> None:
    with pytest.raises(WorkerError, match=r"rank 0 raised:(.|\n)*ValueError: boom from the worker"):
        run_distributed(_raise_value_error, 1, "boom from the worker")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 6, "tp": 4, "pp": 1, "cp": 1}, "world size 6 is not divisible by tp\\*pp\\*cp"),
        ({"world_size": 4, "tp": 2, "pp": 1, "cp": 2}, "context parallelism cp=2 needs Transformer Engine"),
        ({"world_size": 2, "tp": 2, "pp": 1, "cp": 1, "num_attention_heads": 5}, "num_attention_heads=5"),
        ({"world_size": 2, "tp": 2, "pp": 1, "cp": 1, "num_query_groups": 1}, "num_key_value_heads=1"),
        # 3 layers at PP 2 are uneven stages (plan/stages.py), not an error; 1 layer cannot fill 2 stages.
        ({"world_size": 2, "tp": 1, "pp": 2, "cp": 1, "num_layers": 1}, "num_hidden_layers=1 is fewer than the pp=2"),
        ({"world_size": 2, "tp": 0, "pp": 1, "cp": 1}, "tp=0 must be >= 1"),
    ],
)
def test_impossible_layouts_raise_one_line(kwargs: dict[str, int], message: str) -> None:
    from megatron_dapo import parallel

    with pytest.raises(ValueError, match=message) as info:
        parallel.validate_layout(device=torch.device("cpu"), **kwargs)
    assert "\n" not in str(info.value)


def test_slurm_env_gives_ranks_and_master(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_dapo import launcher

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # setenv first so that monkeypatch records the key and removes what launcher_ranks exports.
        monkeypatch.setenv(key, "unset-by-test")
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[03-05,09],cpu1")
    assert launcher.launcher_ranks() == (5, 8, 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    assert launcher.launcher_local_world_size() == 1  # srun without --ntasks-per-node does not say
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")  # equal counts, compressed
    assert launcher.launcher_local_world_size() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's wins
    assert launcher.launcher_local_world_size() == 2
    import os

    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("gpu03", str(20000 + 123456 % 20000))
    assert launcher.first_slurm_host("node7") == "node7"
