"""The frozen reference policy and the KL loss on real log-probs.

- Before any update the reference's log-probs are bitwise the actor's: the KL is exactly 0.
- After one update the actor moves and the reference does not (its log-probs are those
  of the starting checkpoint), so the KL grows.
- The KL the train step reports equals the float64 formula on the two models' log-probs
  (k1 = d, k3 = exp(-d) + d - 1, d = log pi - log pi_ref; token-mean over the response).
At PP 2 too: the reference's log-probs live on the last stage and are broadcast like the actor's.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank

LENGTHS = [20, 17, 15, 12]
PROMPT_LENGTHS = [5, 4, 6, 3]
TEMPERATURE = 0.9


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    width = max(LENGTHS)
    pos = torch.arange(width)
    lens = torch.tensor(LENGTHS)
    ids = torch.where(pos < lens.unsqueeze(1), torch.randint(0, 100, (len(LENGTHS), width), generator=gen), 0)
    response = (pos >= torch.tensor(PROMPT_LENGTHS).unsqueeze(1)) & (pos < lens.unsqueeze(1))
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2]).unsqueeze(1).expand(-1, width).contiguous()
    return {"input_ids": ids, "seq_lens": lens, "response_mask": response, "advantages": adv}


def _worker(pp: int, directory: str) -> dict:
    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch
    from megatron_dapo.actor.reference import ReferencePolicy
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.models import adapter_for

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    dims = parallel.initialize_model_parallel(1, pp, seed=0)
    adapter = adapter_for(directory)
    adam = make_optimizer_config(OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0), dtype=torch.float32,
                                 use_distributed_optimizer=False)
    out: dict = {}
    for kind in ("k3", "k1"):
        actor = MegatronActor(adapter=adapter, dims=dims, optimizer_config=adam, hf_checkpoint=directory,
                              max_tokens_per_microbatch=40, logprob_chunk_size=7)
        reference = ReferencePolicy(actor, directory)
        loss = LossSettings(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type=kind, temperature=TEMPERATURE)
        steps = []
        for _ in range(2):
            batch = RolloutBatch(**_batch())
            batch.ref_log_probs = reference.compute_log_probs(batch, TEMPERATURE)
            actor_log_probs, _ = actor.compute_log_probs(batch, TEMPERATURE)
            metrics = actor.train_step(batch, loss, old_from_forward=True)
            steps.append({"ref": batch.ref_log_probs, "actor": actor_log_probs, "metrics": metrics})
        out[kind] = steps
        out["ref_grad_free"] = all(not p.requires_grad for p in reference.model.parameters())
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("ref") / "qwen2", "qwen2", num_layers=2, seed=12))


def _float64_kl(actor: torch.Tensor, ref: torch.Tensor, kind: str) -> float:
    mask = _batch()["response_mask"].clone()
    mask[:, 0] = False  # token 0 has no log-prob
    d = actor.double()[mask] - ref.double()[mask]
    per_token = d if kind == "k1" else torch.exp(-d) + d - 1.0
    return float(per_token.sum() / mask.sum())


@pytest.mark.parametrize("pp", [1, 2])
def test_kl_is_zero_at_the_start_and_grows(checkpoint: str, pp: int) -> None:
    outs = run_distributed(_worker, pp, pp, checkpoint, timeout_s=300)
    r = outs[0]
    assert r["ref_grad_free"]
    for kind in ("k3", "k1"):
        first, second = r[kind]
        assert torch.equal(first["actor"], first["ref"])  # the same weights, the same forward
        assert first["metrics"]["actor/kl_loss"] == 0.0
        assert torch.equal(second["ref"], first["ref"])  # frozen
        assert not torch.equal(second["actor"], first["actor"])  # the actor moved
        expected = _float64_kl(second["actor"], second["ref"], kind)
        assert second["metrics"]["actor/kl_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-9)
        if kind == "k3":
            assert expected > 1e-6  # KL grows after an update
        for rank_out in outs:  # every stage reports the same
            assert rank_out[kind][1]["metrics"] == second["metrics"]
