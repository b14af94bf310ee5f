"""TP-sharded weights carry megatron's tensor-parallel attributes whether or not they were initialised.

megatron-core's optimizer counts a parameter without ``tensor_model_parallel=True`` as a
copy replicated over TP ranks, so its grad norm (and the global-norm clip) takes such a
weight from TP rank 0 only. megatron-core 0.16 marks its local-spec weights only inside
the weight initialisers; the adapter marks them itself so that loading a checkpoint into
an uninitialised model (init_weights=False, what the actor and the converter do) is safe.

At TP=2, for a Qwen2 checkpoint with untied embeddings (so the output layer is its own
vocab-parallel weight) and qkv biases:
- every parameter the HF mapping shards (vocab, qkv, fc1: dim 0; row: dim 1) is marked with
  that partition_dim, every replicated one (the norms) is not, and the attributes of an
  uninitialised build equal those megatron's initialisers give (fc1's stride 2 included);
- the actor (which builds uninitialised, then loads) reports the grad norm of TP=1 (DP=2,
  the same global batch) to 1e-5 relative, with clipping active, and takes the same step.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank

LENGTHS = [20, 17, 15, 12, 9, 6]
PROMPT_LENGTHS = [5, 4, 6, 3, 4, 2]
# clip 0.05 is below this batch's grad norm, so a wrong norm also changes the step.
ADAM = {"lr": 1e-3, "weight_decay": 0.1, "clip_grad": 0.05}
_EXPECTED_DIM = {"vocab": 0, "qkv": 0, "fc1": 0, "row": 1, "expert_fc1": 0, "expert_row": 1}


def _batch() -> dict[str, torch.Tensor]:
    """Token ids, masks, advantages and old log-probs of the whole batch, [B, S] right-padded."""
    gen = torch.Generator().manual_seed(11)
    width = max(LENGTHS)
    pos = torch.arange(width)
    lens = torch.tensor(LENGTHS)
    ids = torch.where(pos < lens.unsqueeze(1), torch.randint(0, 100, (len(LENGTHS), width), generator=gen), 0)
    response = (pos >= torch.tensor(PROMPT_LENGTHS).unsqueeze(1)) & (pos < lens.unsqueeze(1))
    adv = torch.randn(len(LENGTHS), generator=gen).unsqueeze(1).expand(-1, width).contiguous()
    # Near the log-prob of a uniform policy over 100 tokens, so ratios stay O(1).
    old = -4.6 + 0.3 * torch.randn(len(LENGTHS), width, generator=gen)
    return {"input_ids": ids, "seq_lens": lens, "response_mask": response, "advantages": adv, "old": old}


def _tp_attributes(param: torch.Tensor) -> tuple[bool, int, int]:
    """(tensor_model_parallel, partition_dim, partition_stride), megatron's defaults when unset."""
    return (getattr(param, "tensor_model_parallel", False), getattr(param, "partition_dim", -1),
            getattr(param, "partition_stride", 1))


def _worker(directory: str) -> dict:
    """TP=2: parameter attributes for both init_weights values and one actor step; then TP=1 (DP=2)."""
    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch, balance_across_dp
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.models import adapter_for, mapping
    from megatron_dapo.models.transformer_impl import FUSION_FLAGS

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    t = _batch()
    full = RolloutBatch(input_ids=t["input_ids"], seq_lens=t["seq_lens"], response_mask=t["response_mask"],
                        old_log_probs=t["old"], advantages=t["advantages"])
    adapter = adapter_for(directory)
    out: dict = {"attributes": {}, "steps": {}}
    for tp in (2, 1):
        dims = parallel.initialize_model_parallel(tp, 1, seed=0)
        if tp == 2:
            for init_weights in (True, False):
                model = adapter.build_model(dims, dtype=torch.float32, init_weights=init_weights)
                out["attributes"][init_weights] = {n: _tp_attributes(p) for n, p in model.named_parameters()}
            out["kinds"] = {tm.mcore_name: tm.kind for tm in adapter._maps(model)}
            out["device"] = os.environ["MEGATRON_DAPO_TEST_DEVICE"]
            out["fusions"] = {flag: getattr(model.config, flag) for flag in FUSION_FLAGS}
            assert set(out["kinds"]) == set(out["attributes"][False])
            assert set(mapping.KINDS) == set(_EXPECTED_DIM) | {"replicated"}
        config = make_optimizer_config(OptimConfig(**ADAM), dtype=torch.float32, use_distributed_optimizer=True)
        actor = MegatronActor(adapter=adapter, dims=dims, optimizer_config=config, hf_checkpoint=directory,
                              max_tokens_per_microbatch=60)
        metrics = actor.train_step(full.select(balance_across_dp(LENGTHS, dims.dp)[dims.dp_rank]), LossSettings())
        weights = dict(adapter.export_hf(actor.model, dims))
        out["steps"][tp] = {"dp": dims.dp, "metrics": metrics, "weights": weights if dims.rank == 0 else None}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("tp_attrs") / "qwen2", "qwen2", num_layers=2, seed=9)
    return run_distributed(_worker, 2, str(directory), timeout_s=300)


def test_sharded_weights_are_marked_for_both_init_values(results: list[dict]) -> None:
    for rank_out in results:
        kinds = rank_out["kinds"]
        # The checkpoint has every kind of tensor: embedding/output, fused qkv (+ bias), fc1, rows, norms.
        assert sorted(set(kinds.values())) == ["fc1", "qkv", "replicated", "row", "vocab"]
        assert kinds["output_layer.weight"] == "vocab"
        assert kinds["decoder.layers.0.self_attention.linear_qkv.bias"] == "qkv"
        for init_weights in (True, False):
            attributes = rank_out["attributes"][init_weights]
            for name, kind in kinds.items():
                marked, dim, _ = attributes[name]
                if kind == "replicated":
                    assert (marked, dim) == (False, -1), (init_weights, name, attributes[name])
                else:
                    assert (marked, dim) == (True, _EXPECTED_DIM[kind]), (init_weights, name, attributes[name])
        # Uninitialised weights get exactly megatron's own marks, partition_stride included.
        assert rank_out["attributes"][False] == rank_out["attributes"][True]
        strides = {n: a[2] for n, a in rank_out["attributes"][False].items() if a[2] != 1}
        assert strides == {f"decoder.layers.{i}.mlp.linear_fc1.weight": 2 for i in range(2)}


def test_actor_grad_norm_at_tp2_equals_tp1(results: list[dict]) -> None:
    tp2, tp1 = results[0]["steps"][2], results[0]["steps"][1]
    assert (tp2["dp"], tp1["dp"]) == (1, 2)
    norm2, norm1 = tp2["metrics"]["actor/grad_norm"], tp1["metrics"]["actor/grad_norm"]
    print(f"grad norm tp2 {norm2:.6f} tp1 {norm1:.6f}")
    assert norm1 > ADAM["clip_grad"]  # the clip is active, so the norm scales the step
    assert abs(norm2 - norm1) <= 1e-5 * norm1, (norm2, norm1)
    for rank_out in results:  # every rank reports the same
        assert rank_out["steps"][2]["metrics"]["actor/grad_norm"] == norm2
    rel = max(float((tp2["weights"][n] - w).norm() / w.norm()) for n, w in tp1["weights"].items())
    assert rel < 1e-5, rel


def test_cpu_models_keep_megatrons_unfused_kernels(results: list[dict]) -> None:
    """The fusions need TE, apex or triton on CUDA (models/transformer_impl.kernel_fusions); none on CPU."""
    for rank_out in results:
        assert len(rank_out["fusions"]) == 6
        if rank_out["device"] == "cpu":
            assert rank_out["fusions"] == dict.fromkeys(rank_out["fusions"], False)
