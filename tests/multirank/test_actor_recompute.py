"""Full activation recompute runs on CPU and does not change the actor's update.

Megatron's full recompute (granularity "full", method "uniform") re-runs each layer's
forward inside the backward pass; on CPU that recomputed forward must still see the
device layer's CUDA-to-CPU remapping (it builds the causal mask with device="cuda").
Selective recompute (core attention) re-runs the attention the same way. One tiny random
Qwen2 checkpoint, one batch of 4 sequences of different lengths, one AdamW step with
recompute="none" and with recompute="full" at TP=1 and TP=2 (and "selective" at TP=1):
the recomputed forward is the same fp32 computation on the same inputs, so the
HF-exported weights and the reported metrics must be bit-identical, and the step must
have moved the weights (so the comparison is not between two untouched copies).
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank

LENGTHS = [14, 11, 8, 5]
PROMPT_LENGTHS = [4, 3, 2, 2]
# Two micro-batches, so recomputed layers run in a schedule with several backward passes.
TOKEN_BUDGET = 30
ADAM = {"lr": 1e-3, "weight_decay": 0.1, "clip_grad": 1.0}


def _batch() -> dict[str, torch.Tensor]:
    """Token ids, masks, advantages and old log-probs of the batch, [B, S] right-padded."""
    gen = torch.Generator().manual_seed(5)
    width = max(LENGTHS)
    pos = torch.arange(width)
    lens = torch.tensor(LENGTHS)
    ids = torch.where(pos < lens.unsqueeze(1), torch.randint(0, 100, (len(LENGTHS), width), generator=gen), 0)
    response = (pos >= torch.tensor(PROMPT_LENGTHS).unsqueeze(1)) & (pos < lens.unsqueeze(1))
    adv = torch.randn(len(LENGTHS), generator=gen).unsqueeze(1).expand(-1, width).contiguous()
    # Old log-probs near those of a near-uniform policy over 100 tokens, so ratios stay O(1).
    old = -4.6 + 0.3 * torch.randn(len(LENGTHS), width, generator=gen)
    return {"input_ids": ids, "seq_lens": lens, "response_mask": response, "advantages": adv, "old": old}


def _recompute_worker(tp_sizes: list[int], modes: list[str], directory: str) -> dict:
    """For each TP size (one data-parallel replica per TP group): one step per recompute mode."""
    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.models import adapter_for

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    t = _batch()
    batch = RolloutBatch(input_ids=t["input_ids"], seq_lens=t["seq_lens"], response_mask=t["response_mask"],
                         old_log_probs=t["old"], advantages=t["advantages"])
    results: dict = {}
    for tp in tp_sizes:
        dims = parallel.initialize_model_parallel(tp, 1, seed=0)
        assert dims.dp == 1, "every rank must see the whole batch"
        adapter = adapter_for(directory)
        config = make_optimizer_config(OptimConfig(**ADAM), dtype=torch.float32, use_distributed_optimizer=True)
        for recompute in modes:
            actor = MegatronActor(adapter=adapter, dims=dims, optimizer_config=config, hf_checkpoint=directory,
                                  recompute=recompute, max_tokens_per_microbatch=TOKEN_BUDGET)
            num_microbatches = len(actor._microbatches(batch))
            metrics = actor.train_step(batch, LossSettings())
            weights = dict(adapter.export_hf(actor.model, dims))
            results[(tp, recompute)] = {
                "config": (actor.model.config.recompute_granularity, actor.model.config.recompute_method),
                "num_microbatches": num_microbatches,
                "metrics": metrics,
                "weights": weights if dims.rank == 0 else None,
            }
    return results


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("recompute") / "qwen2", "qwen2", num_layers=2, seed=7))


_CONFIGS = {"none": (None, None), "full": ("full", "uniform"), "selective": ("selective", None)}


def check_recompute_matches(results: dict, tp: int, recompute: str, checkpoint: str) -> None:
    """Assert that ``recompute`` reproduces recompute="none" bit for bit at this TP size."""
    from safetensors.torch import load_file

    plain, other = results[(tp, "none")], results[(tp, recompute)]
    assert plain["config"] == _CONFIGS["none"]
    assert other["config"] == _CONFIGS[recompute]
    assert plain["num_microbatches"] == other["num_microbatches"] == 2
    initial = load_file(os.path.join(checkpoint, "model.safetensors"))
    assert sorted(other["weights"]) == sorted(initial)
    moved = min(float((plain["weights"][n] - w).abs().max()) for n, w in initial.items())
    assert moved > 1e-4, moved  # AdamW's first step moves every weight by about lr
    unequal = sorted(n for n in initial if not torch.equal(other["weights"][n], plain["weights"][n]))
    assert unequal == [], (tp, recompute, unequal)
    assert other["metrics"] == plain["metrics"]


def test_recompute_matches_no_recompute_tp1(checkpoint: str) -> None:
    (results,) = run_distributed(_recompute_worker, 1, [1], ["none", "full", "selective"], checkpoint)
    check_recompute_matches(results, 1, "full", checkpoint)
    check_recompute_matches(results, 1, "selective", checkpoint)


def test_full_recompute_matches_no_recompute_tp2(checkpoint: str) -> None:
    results = run_distributed(_recompute_worker, 2, [2], ["none", "full"], checkpoint)
    check_recompute_matches(results[0], 2, "full", checkpoint)
    assert results[1][(2, "full")]["metrics"] == results[0][(2, "full")]["metrics"]
