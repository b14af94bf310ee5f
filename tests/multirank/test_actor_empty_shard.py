"""A data-parallel rank with no sequences joins every collective and contributes nothing.

The RL path never produces one (config.check_world_size rejects ppo_mini_batch_size x n <
dp, and dynamic sampling gives exactly train_batch_size groups of n), but the SFT warm
start does when model.sft_warm_start.batch_size < dp, and a rank's share is cut further
into token-budget micro-batches. On 2 DP ranks the split ([a, b], [c]) and the split
([a, b, c], []) must give the same log-probs, metrics and updated weights: the empty rank
runs as many (empty) micro-batches as its peer, and the global token and sequence counts
are the same.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank

LENGTHS = [14, 9, 11]
PROMPT_LENGTHS = [4, 3, 5]
SPLITS = {"balanced": [[0, 1], [2]], "one_empty": [[0, 1, 2], []]}


def _batch():
    from megatron_dapo.actor.microbatch import RolloutBatch

    gen = torch.Generator().manual_seed(1)
    width = max(LENGTHS)
    pos = torch.arange(width)
    lens = torch.tensor(LENGTHS)
    ids = torch.where(pos < lens[:, None], torch.randint(0, 100, (len(LENGTHS), width), generator=gen), 0)
    response = (pos >= torch.tensor(PROMPT_LENGTHS)[:, None]) & (pos < lens[:, None])
    adv = torch.tensor([1.0, -0.5, 0.75])[:, None].expand(-1, width).contiguous()
    return RolloutBatch(input_ids=ids, seq_lens=lens, response_mask=response, advantages=adv)


def _worker(directory: str) -> dict:
    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.models import adapter_for

    parallel.init_distributed("cpu")
    dims = parallel.initialize_model_parallel(1, 1, seed=0)
    adapter = adapter_for(directory)
    adam = make_optimizer_config(OptimConfig(lr=1e-3, weight_decay=0.1), dtype=torch.float32,
                                 use_distributed_optimizer=True)
    rl = LossSettings(clip_ratio_low=0.2, clip_ratio_high=0.28, use_kl_loss=True, kl_loss_coef=0.1,
                      entropy_coeff=0.01, loss_agg_mode="seq-mean-token-mean")
    out: dict = {}
    for split, shards in SPLITS.items():
        mine = _batch().select(shards[dims.dp_rank])
        # A budget of one sequence: the full rank runs 3 micro-batches, the empty one 3 empty ones.
        actor = MegatronActor(adapter=adapter, dims=dims, optimizer_config=adam, hf_checkpoint=directory,
                              max_tokens_per_microbatch=16)
        old, _ = actor.compute_log_probs(mine, 1.0, response_only=True)
        mine.old_log_probs = old - 0.05 * mine.response_mask  # a ratio away from 1: clipping is live
        mine.ref_log_probs = old - 0.1
        metrics = actor.train_step(mine, rl)
        weights = dict(adapter.export_hf(actor.model, dims))
        # The SFT warm start's step: old log-probs from the update's own forward.
        sft = MegatronActor(adapter=adapter, dims=dims, optimizer_config=adam, hf_checkpoint=directory,
                            max_tokens_per_microbatch=16)
        fresh = _batch().select(shards[dims.dp_rank])
        sft_metrics = sft.train_step(fresh, LossSettings(clip_ratio_low=0.2, clip_ratio_high=0.2),
                                     old_from_forward=True)
        out[split] = {"rows": shards[dims.dp_rank], "old": old, "metrics": metrics, "weights": weights,
                      "sft_metrics": sft_metrics, "sft_old": fresh.old_log_probs,
                      "sft_weights": dict(adapter.export_hf(sft.model, dims))}
    return out


def test_an_empty_data_parallel_shard_contributes_nothing_and_hangs_nothing(tmp_path) -> None:
    directory = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", num_layers=2, seed=2)
    ranks = run_distributed(_worker, 2, str(directory), timeout_s=600)
    assert ranks[1]["one_empty"]["rows"] == [] and ranks[1]["one_empty"]["old"].shape[0] == 0

    # Old log-probs per sequence do not depend on the split.
    def by_row(split: str, key: str) -> dict[int, torch.Tensor]:
        return {i: r[split][key][k, :LENGTHS[i]] for r in ranks for k, i in enumerate(r[split]["rows"])}

    for key in ("old", "sft_old"):
        balanced, one_empty = by_row("balanced", key), by_row("one_empty", key)
        assert all(torch.allclose(balanced[i], one_empty[i], atol=1e-5) for i in range(len(LENGTHS))), key

    for metrics, weights in (("metrics", "weights"), ("sft_metrics", "sft_weights")):
        a, b = ranks[0]["balanced"], ranks[0]["one_empty"]
        assert a[metrics].keys() == b[metrics].keys()
        for name, value in a[metrics].items():
            assert b[metrics][name] == pytest.approx(value, rel=1e-4, abs=1e-6), (metrics, name)
        assert a[metrics]["actor/grad_norm"] > 0
        for name, tensor in a[weights].items():
            err = float((tensor - b[weights][name]).norm() / tensor.norm())
            assert err < 1e-5, (weights, name, err)
        # Every rank ends with the same metrics, the empty one included.
        assert ranks[1]["one_empty"][metrics] == b[metrics]
