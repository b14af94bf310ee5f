"""The actor's DAPO step is layout-independent and equals the whole-batch loss's gradient.

One tiny random Qwen2 checkpoint (tied embeddings, so PP=2 exercises the shared
embedding's gradient sync), one batch of 6 sequences of different lengths whose prompts
are shared as in a GRPO batch (rows 0-2 one prompt, rows 3-4 another, row 5 its own), one
loss with every term on (Clip-Higher, dual clip, entropy bonus, KL). The actor's default
shared-prompt layout (actor/shared_layout.py) runs every layout; the single process also
runs padded rows (trainer.shared_prompts=false). For each layout
(TP, PP, DP) in (1,1,1), (2,1,1), (1,2,1), (1,1,2), (2,2,1) and each micro-batch budget
that cuts the batch 1, 2 and 5 ways (DP ranks then run equalised counts):
- compute_log_probs equals a float64 log_softmax of transformers' logits (< 1e-4);
- one AdamW step gives the same HF-exported weights as the single-process, one-micro-batch
  reference;
- one plain SGD step (no decay, no clip, no momentum) moves the weights by exactly
  the float64 gradient of the whole-batch loss computed with transformers: the gradient
  itself, with no optimizer in between to hide or amplify errors; for token-mean (DAPO)
  and seq-mean-token-mean (GRPO, global sequence count), and the loss modes gspo and geo_mean.
Several layouts share one spawned job since spawning and importing megatron dominate.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank

LENGTHS = [20, 17, 15, 12, 9, 6]
PROMPT_LENGTHS = [5, 5, 5, 3, 3, 2]
PROMPT_OF = [0, 0, 0, 3, 3, 5]  # the row whose prompt tokens each row shares
# Micro-batches of the whole batch on one rank -> token budget, each prompt counted once
# per micro-batch (66 tokens in all; 20 cuts it 5 ways and gives DP rank 1 three).
BUDGETS = {1: 120, 2: 60, 5: 20}
TEMPERATURE = 0.9
LOSS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "entropy_coeff": 0.01,
        "use_kl_loss": True, "kl_loss_coef": 0.05, "kl_loss_type": "low_var_kl", "temperature": TEMPERATURE}
# clip 0.1 < the batch's grad norm (0.25), so the global-norm clip is exercised too.
ADAM = {"lr": 1e-3, "weight_decay": 0.1, "clip_grad": 0.1}
# Tolerances, as measured: weights rel. err <= 1.8e-6 (bound 1e-5). The update itself
# (w1 - w0) differs by up to 3.4e-4 relative (bound 1e-3): AdamW's first step is
# lr * g / (|g| + eps), which for elements with |g| ~ eps = 1e-8 turns fp32
# reduction-order noise in g (~1e-9, different per layout and micro-batching) into an
# update difference up to lr * noise / eps. With adam_eps 1e-6 it drops to 3e-5. The SGD
# check is the exact one: the gradient matches float64 to <= 2.4e-6 in every layout.
# A large step makes (w0 - w1) / lr read the gradient at fp32 precision of the update, not
# of the weights: at lr 1 a q_proj gradient of norm 6e-4 is lost in w0's rounding (1e-3 rel).
SGD_LR = 1e4
# The SGD check's losses: DAPO, GRPO, and two sequence-level loss modes (GSPO's sequence ratio with
# its token-level gradient, GMPO's geometric mean), whose per-sequence sums must come out whole
# under every layout and micro-batch cut (clip bounds that clip part of this batch).
SGD_CASES = {
    "token-mean": {"loss_agg_mode": "token-mean"},
    "seq-mean-token-mean": {"loss_agg_mode": "seq-mean-token-mean"},
    "gspo": {"loss_mode": "gspo", "loss_agg_mode": "seq-mean-token-mean", "clip_ratio_low": 0.02,
             "clip_ratio_high": 0.03, "clip_ratio_c": None},
    "geo_mean": {"loss_mode": "geo_mean", "loss_agg_mode": "seq-mean-token-mean", "clip_ratio_low": 0.1,
                 "clip_ratio_high": 0.1, "clip_ratio_c": None},
}


def _batch_tensors() -> dict[str, torch.Tensor]:
    """Token ids and masks of the whole batch, [B, S] right-padded, token-aligned."""
    gen = torch.Generator().manual_seed(3)
    width = max(LENGTHS)
    ids = torch.randint(0, 100, (len(LENGTHS), width), generator=gen)
    for row, (source, plen) in enumerate(zip(PROMPT_OF, PROMPT_LENGTHS, strict=True)):
        ids[row, :plen] = ids[source, :plen]
    pos = torch.arange(width)
    lens = torch.tensor(LENGTHS)
    response = (pos >= torch.tensor(PROMPT_LENGTHS).unsqueeze(1)) & (pos < lens.unsqueeze(1))
    ids = torch.where(pos < lens.unsqueeze(1), ids, 0)
    adv = torch.randn(len(LENGTHS), generator=gen).unsqueeze(1).expand(-1, width).contiguous()
    return {"input_ids": ids, "seq_lens": lens, "response_mask": response, "advantages": adv,
            "noise_old": 0.3 * torch.randn(len(LENGTHS), width, generator=gen),
            "noise_ref": 0.2 * torch.randn(len(LENGTHS), width, generator=gen)}


def _hf_reference(directory: Path, **load_kwargs: object) -> dict[str, object]:
    """float64 transformers: token log-probs, old/ref log-probs, and the whole-batch loss gradient.

    load_kwargs go to from_pretrained (MoE models need experts_implementation="eager" in float64).
    """
    from transformers import AutoModelForCausalLM

    from megatron_dapo.algo import agg_loss, compute_policy_loss, kl_penalty

    t = _batch_tensors()
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float64, attn_implementation="eager",
                                                 **load_kwargs)
    num_seqs, width = t["input_ids"].shape
    log_probs = torch.zeros(num_seqs, width, dtype=torch.float64)
    entropy = torch.zeros(num_seqs, width, dtype=torch.float64)
    for b, length in enumerate(LENGTHS):  # one sequence at a time: no padding at all
        logits = model(input_ids=t["input_ids"][b:b + 1, :length]).logits[0] / TEMPERATURE  # [L, V]
        log_p = torch.log_softmax(logits, dim=-1)
        log_probs[b, 1:length] = log_p[:-1].gather(-1, t["input_ids"][b, 1:length].unsqueeze(-1)).squeeze(-1)
        entropy[b, 1:length] = -(log_p.exp() * log_p).sum(-1)[:-1]
    mask = t["response_mask"].clone()
    mask[:, 0] = False
    old = (log_probs.detach() + t["noise_old"].double()).float().double()
    ref = (log_probs.detach() + t["noise_ref"].double()).float().double()
    out: dict[str, object] = {"log_probs": log_probs.detach(), "old": old.float(), "ref": ref.float(),
                              "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}
    for mode, case in SGD_CASES.items():
        kw = {**LOSS, **case}
        agg = kw["loss_agg_mode"]
        pg_loss, metrics = compute_policy_loss(log_probs, old, t["advantages"].double(), mask,
                                               kw["clip_ratio_low"], kw["clip_ratio_high"],
                                               kw["clip_ratio_c"], loss_agg_mode=agg,
                                               loss_mode=kw.get("loss_mode", "vanilla"))
        kl_loss = agg_loss(kl_penalty(log_probs, ref, LOSS["kl_loss_type"]), mask, agg)
        total = pg_loss - LOSS["entropy_coeff"] * agg_loss(entropy, mask, agg) + LOSS["kl_loss_coef"] * kl_loss
        model.zero_grad()
        total.backward(retain_graph=True)
        out[f"grads/{mode}"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        if mode == "token-mean":
            out.update(pg_loss=pg_loss.item(), pg_clipfrac=metrics["pg_clipfrac"].item(), kl_loss=kl_loss.item())
    return out


def _layout_worker(layouts: list[tuple[int, int]], directory: str, old: torch.Tensor, ref: torch.Tensor,
                   shared_prompts: bool = True) -> dict:
    """For each (tp, pp) layout (dp = world / tp / pp): log-probs, AdamW steps per budget, one SGD step."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import MegatronActor, make_optimizer_config
    from megatron_dapo.actor.microbatch import RolloutBatch, balance_across_dp
    from megatron_dapo.actor.optimizer_state import materialize_optimizer_state
    from megatron_dapo.algo import LossSettings
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.models import adapter_for

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    t = _batch_tensors()
    full = RolloutBatch(input_ids=t["input_ids"], seq_lens=t["seq_lens"], response_mask=t["response_mask"],
                        old_log_probs=old, advantages=t["advantages"], ref_log_probs=ref)
    loss = LossSettings(**LOSS)
    results: dict = {}
    for tp, pp in layouts:
        dims = parallel.initialize_model_parallel(tp, pp, seed=0)
        mine = full.select(balance_across_dp(LENGTHS, dims.dp)[dims.dp_rank])
        adapter = adapter_for(directory)

        def actor(config: OptimizerConfig, budget: int, dims=dims, adapter=adapter) -> MegatronActor:
            return MegatronActor(adapter=adapter, dims=dims, optimizer_config=config, hf_checkpoint=directory,
                                 max_tokens_per_microbatch=budget, logprob_chunk_size=7,
                                 shared_prompts=shared_prompts)

        def export(a: MegatronActor, dims=dims, adapter=adapter) -> dict[str, torch.Tensor] | None:
            weights = dict(adapter.export_hf(a.model, dims))
            return weights if dims.rank == 0 else None

        adam = make_optimizer_config(OptimConfig(**ADAM), dtype=torch.float32, use_distributed_optimizer=True)
        out: dict = {"dp": dims.dp, "steps": {}}
        for ways, budget in BUDGETS.items():
            a = actor(adam, budget)
            if ways == 5:
                log_probs, entropy = a.compute_log_probs(mine, TEMPERATURE)
                out["log_probs"], out["entropy"] = log_probs, entropy
                out["response_log_probs"], _ = a.compute_log_probs(mine, TEMPERATURE, response_only=True)
                out["response_mask"] = mine.response_mask
                out["num_microbatches"] = len(a._microbatches(mine))
            metrics = a.train_step(mine, loss)
            out["steps"][ways] = {"metrics": metrics, "weights": export(a)}
            if ways == 2:
                # The state the run makes before the engines start (run.py) steps bit-equal to the
                # lazy one, through megatron's distributed optimizer and its fp32 shards.
                eager = actor(adam, budget)
                out["state_made_bytes"] = materialize_optimizer_state(eager.optimizer)
                eager.train_step(mine, loss)
                out["eager_weights"] = export(eager)
        sgd = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=SGD_LR, min_lr=SGD_LR, weight_decay=0.0,
                              clip_grad=0.0, params_dtype=torch.float32, use_distributed_optimizer=False)
        for mode, case in SGD_CASES.items():
            a = actor(sgd, BUDGETS[5])
            a.train_step(mine, LossSettings(**{**LOSS, **case}))
            out[f"sgd_weights/{mode}"] = export(a)
        out["indices"] = balance_across_dp(LENGTHS, dims.dp)[dims.dp_rank]
        results[(tp, pp)] = out
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("actor") / "qwen2", "qwen2",
                                     tie_word_embeddings=True, seed=4)
    reference = _hf_reference(directory)
    (single,) = run_distributed(_layout_worker, 1, [(1, 1)], str(directory), reference["old"], reference["ref"])
    (padded,) = run_distributed(_layout_worker, 1, [(1, 1)], str(directory), reference["old"], reference["ref"],
                                False)
    return {"dir": str(directory), "hf": reference, "single": single[(1, 1)], "padded": padded[(1, 1)]}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _check_layout(out_by_rank: list[dict], layout: tuple[int, int], setup: dict) -> dict[str, float]:
    hf, single = setup["hf"], setup["single"]
    errors: dict[str, float] = {}
    # Log-probs and entropy: every rank returns its DP share, aligned with its input_ids.
    for out in out_by_rank:
        r = out[layout]
        idx = r["indices"]
        width = r["log_probs"].shape[1]
        valid = torch.zeros(len(idx), width, dtype=torch.bool)
        for row, i in enumerate(idx):
            valid[row, 1:LENGTHS[i]] = True
        diff = (r["log_probs"].double() - hf["log_probs"][idx, :width]).abs()[valid].max()
        errors["log_prob_abs"] = max(errors.get("log_prob_abs", 0.0), float(diff))
        assert float(diff) < 1e-4, (layout, float(diff))
        assert float(r["log_probs"][~valid].abs().max()) == 0.0
        # response_only computes the response positions alone, the same values, 0 elsewhere.
        response = r["response_mask"]
        assert float((r["response_log_probs"] - r["log_probs"]).abs()[response].max()) < 1e-6
        assert float(r["response_log_probs"][~response].abs().max()) == 0.0
    r0 = out_by_rank[0][layout]
    # Plain SGD: (w0 - w1) / lr is the gradient; compare with float64 transformers.
    for mode in SGD_CASES:
        grad_err = max(_rel((hf["weights"][n] - r0[f"sgd_weights/{mode}"][n].double()) / SGD_LR, g)
                       for n, g in hf[f"grads/{mode}"].items())
        errors[f"grad_rel/{mode}"] = grad_err
        assert grad_err < 1e-5, (layout, mode, grad_err)
    for ways in BUDGETS:
        step, ref_step = r0["steps"][ways], single["steps"][1]
        w_err = max(_rel(step["weights"][n], ref_step["weights"][n]) for n in ref_step["weights"])
        update_err = max(_rel(step["weights"][n] - hf["weights"][n].float(),
                              ref_step["weights"][n] - hf["weights"][n].float())
                         for n in ref_step["weights"])
        errors[f"weight_rel_{ways}"] = w_err
        errors[f"update_rel_{ways}"] = update_err
        assert w_err < 1e-5, (layout, ways, w_err)
        assert update_err < 1e-3, (layout, ways, update_err)
        for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
            a, b = step["metrics"][name], ref_step["metrics"][name]
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (layout, ways, name, a, b)
        assert step["metrics"]["actor/lr"] == ADAM["lr"]
        for rank_out in out_by_rank:  # every rank reports the same metrics
            assert rank_out[layout]["steps"][ways]["metrics"] == step["metrics"]
    # Adam's state made before the first step (actor/optimizer_state.py) changes no bit of it.
    lazy = r0["steps"][2]["weights"]
    assert all(torch.equal(r0["eager_weights"][n], lazy[n]) for n in lazy), layout
    assert all(rank_out[layout]["state_made_bytes"] > 0 for rank_out in out_by_rank)
    return errors


def test_single_process_matches_transformers(setup: dict) -> None:
    hf, single = setup["hf"], setup["single"]
    errors = _check_layout([{(1, 1): single}], (1, 1), setup)
    assert single["num_microbatches"] == 5
    # Padded rows (trainer.shared_prompts=false) meet the same float64 reference.
    print("padded-rows errors:", _check_layout([{(1, 1): setup["padded"]}], (1, 1), setup))
    metrics = single["steps"][1]["metrics"]
    assert abs(metrics["actor/pg_loss"] - hf["pg_loss"]) < 1e-5
    assert abs(metrics["actor/pg_clipfrac"] - hf["pg_clipfrac"]) < 1e-6
    assert abs(metrics["actor/kl_loss"] - hf["kl_loss"]) < 1e-5
    assert 0.0 < metrics["actor/pg_clipfrac"] < 1.0  # the batch does exercise the clip
    assert metrics["actor/grad_norm"] > ADAM["clip_grad"]  # and the global-norm clip
    assert sorted(metrics) == ["actor/entropy", "actor/grad_norm", "actor/kl_loss", "actor/lr", "actor/pg_clipfrac",
                               "actor/pg_clipfrac_lower", "actor/pg_loss", "actor/ppo_kl"]
    print("single-process errors:", errors)


def test_two_rank_layouts_tp2_pp2_dp2(setup: dict) -> None:
    layouts = [(2, 1), (1, 2), (1, 1)]
    out = run_distributed(_layout_worker, 2, layouts, setup["dir"], setup["hf"]["old"], setup["hf"]["ref"],
                          timeout_s=300)
    assert out[0][(1, 1)]["dp"] == 2
    # The 5-way budget gives DP rank 0 two micro-batches and rank 1 three: both run three.
    assert [r[(1, 1)]["num_microbatches"] for r in out] == [3, 3]
    for layout in layouts:
        print(layout, _check_layout(out, layout, setup))


def test_four_rank_layout_tp2_pp2(setup: dict) -> None:
    out = run_distributed(_layout_worker, 4, [(2, 2)], setup["dir"], setup["hf"]["old"], setup["hf"]["ref"],
                          timeout_s=300)
    print((2, 2), _check_layout(out, (2, 2), setup))
