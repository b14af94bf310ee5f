"""Sequence parallelism changes where activations live, never the numbers: TP 2 and TP 2 x PP 2.

With parallel.sequence_parallel the TransformerConfig gets the flag, the local (non-TE)
spec gets norms whose weight gradients megatron all-reduces over TP, and every micro-batch
is padded to a multiple of TP (the lengths here are odd, so the padding is exercised).
Against the same layout with SP off (fp32): log-probs, one AdamW step's weights and one
plain SGD step's weights (SGD reads the gradient itself: a norm gradient left as a
per-rank partial sum would show here, while Adam's first step is nearly sign(g)).
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank

LENGTHS = [21, 17, 15, 12, 9]
PROMPT_LENGTHS = [5, 4, 4, 3, 4]  # rows 1 and 2 share their prompt (the shared-prompt layout)
TEMPERATURE = 0.9
SGD_LR = 1e4


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(8)
    width = max(LENGTHS)
    pos = torch.arange(width)
    lens = torch.tensor(LENGTHS)
    ids = torch.where(pos < lens.unsqueeze(1), torch.randint(0, 100, (len(LENGTHS), width), generator=gen), 0)
    ids[2, :4] = ids[1, :4]
    response = (pos >= torch.tensor(PROMPT_LENGTHS).unsqueeze(1)) & (pos < lens.unsqueeze(1))
    adv = torch.randn(len(LENGTHS), generator=gen).unsqueeze(1).expand(-1, width).contiguous()
    old = 0.2 * torch.randn(len(LENGTHS), width, generator=gen)
    return {"input_ids": ids, "seq_lens": lens, "response_mask": response, "advantages": adv, "noise": old}


def _worker(tp: int, pp: int, directory: str) -> dict:
    from megatron.core.optimizer import OptimizerConfig

    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.models import adapter_for, unwrap_model

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    dims = parallel.initialize_model_parallel(tp, pp, seed=0)
    adapter = adapter_for(directory)
    t = _batch()
    noise = t.pop("noise")
    loss = LossSettings(clip_ratio_c=3.0, entropy_coeff=0.01, temperature=TEMPERATURE)
    adam = make_optimizer_config(OptimConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0), dtype=torch.float32,
                                 use_distributed_optimizer=True)
    sgd = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=SGD_LR, min_lr=SGD_LR, weight_decay=0.0,
                          clip_grad=0.0, params_dtype=torch.float32, use_distributed_optimizer=False)
    out: dict = {}
    for sp in (False, True):
        for name, config in (("adam", adam), ("sgd", sgd)):
            # Budget 29: packed micro-batches of 28 (rows 1 + 2 sharing 4 prompt tokens), 21 and
            # 12 + 9 tokens; the odd ones are padded to even under SP.
            actor = MegatronActor(adapter=adapter, dims=dims, optimizer_config=config, hf_checkpoint=directory,
                                  max_tokens_per_microbatch=29, logprob_chunk_size=7, sequence_parallel=sp)
            batch = RolloutBatch(**t)
            log_probs, entropy = actor.compute_log_probs(batch, TEMPERATURE)
            batch.old_log_probs = log_probs + noise
            widths = [mb.input_ids.shape[1] for mb in actor._microbatches(batch)]
            metrics = actor.train_step(batch, loss)
            out[(sp, name)] = {"log_probs": log_probs, "entropy": entropy, "metrics": metrics, "widths": widths,
                               "weights": dict(adapter.export_hf(actor.model, dims)),
                               "config_sp": unwrap_model(actor.model).config.sequence_parallel}
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("sp") / "qwen2", "qwen2", num_layers=2, seed=9,
                                    tie_word_embeddings=True))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)], ids=["tp2", "tp2xpp2"])
def test_sequence_parallel_equals_sp_off(checkpoint: str, tp: int, pp: int) -> None:
    outs = run_distributed(_worker, tp * pp, tp, pp, checkpoint, timeout_s=400)
    for r in outs:
        off, on = r[(False, "adam")], r[(True, "adam")]
        assert not off["config_sp"] and on["config_sp"]
        assert any(w % 2 for w in off["widths"]) and all(w % tp == 0 for w in on["widths"])
        assert _rel(on["log_probs"], off["log_probs"]) < 1e-5
        assert _rel(on["entropy"], off["entropy"]) < 1e-5
        for name in ("adam", "sgd"):
            off, on = r[(False, name)], r[(True, name)]
            err = max(_rel(on["weights"][n], off["weights"][n]) for n in off["weights"])
            assert err < 1e-5, (name, err)
            for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
                assert on["metrics"][key] == pytest.approx(off["metrics"][key], rel=1e-5), key
