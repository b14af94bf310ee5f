"""The policy-loss modes against float64 references written from their papers, and against verl 0.9.1's
own functions (tests/unit/verl_core_algos.py), on random inputs, whole and split over micro-batches.

The references loop over sequences and tokens and follow each paper's formula, not the code
under test: GSPO's sequence ratio (mean log-ratio, then its token-level form), CISPO's
stop-gradient clipped IS weight, SAPO's soft gate, GMPO's geometric mean taken as a product
of ratios clipped in ratio space, and the covariance selection of Clip-Cov / KL-Cov. They
compare the loss and its gradient with respect to the current log-probs.
"""

from __future__ import annotations

import math

import pytest
import torch
from verl_core_algos import ActorConfig, load_core_algos

from megatron_dapo.algo import compute_policy_loss
from megatron_dapo.algo.loss_inputs import ModeParams
from megatron_dapo.algo.loss_modes import POLICY_LOSS_MODES
from megatron_dapo.config import LOSS_MODE_SPECS

TOL = 1e-6
# Clip bounds that clip some tokens / sequences of the random batches (GSPO's paper values,
# 3e-4 / 4e-4, would clip every sequence of these short random rows).
CLIPS = {"vanilla": (0.2, 0.28), "gspo": (0.02, 0.03), "cispo": (0.15, 0.1), "sapo": (None, None),
         "geo_mean": (0.1, 0.12), "clip_cov": (0.2, 0.2), "kl_cov": (None, None)}
PARAMS = ModeParams(clip_cov_ratio=1.0, clip_cov_lb=0.02, clip_cov_ub=0.5, kl_cov_ratio=0.1, ppo_kl_coef=0.7,
                    tau_pos=1.3, tau_neg=2.1)


def _batch(seed: int, rows: int = 6, width: int = 9, empty_row: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, width, generator=g) > 0.25  # holes = tool tokens; trailing = padding
    mask[:, 0] = True
    if empty_row:
        mask[-1] = False
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    log_prob = old + 0.15 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    log_prob = torch.where(mask, log_prob, torch.full_like(log_prob, float("nan")))  # NaN padding
    adv = torch.randn(rows, generator=g, dtype=torch.float64).unsqueeze(-1).expand(rows, width).clone()
    is_w = 0.5 + torch.rand(rows, width, generator=g, dtype=torch.float64)
    return {"log_prob": log_prob, "old": old, "adv": adv, "mask": mask, "is_w": is_w}


def _ours(b, mode, rows=slice(None), *, n_tokens, n_seqs, is_w=True, seed=0, clip_c=None):
    lp = b["log_prob"][rows].clone().requires_grad_(True)
    low, high = CLIPS[mode]
    loss, metrics = compute_policy_loss(
        lp, b["old"][rows], b["adv"][rows], b["mask"][rows], low, high, clip_c,
        loss_agg_mode=LOSS_MODE_SPECS[mode].agg_modes[0], num_global_tokens=n_tokens, num_global_seqs=n_seqs,
        is_weights=b["is_w"][rows] if is_w else None, loss_mode=mode, params=PARAMS,
        generator=torch.Generator().manual_seed(seed))
    loss.backward()
    return loss, torch.nan_to_num(lp.grad), metrics


# ----------------------------------------------------------------------------- references


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _cov_scores(b, rows) -> list[tuple[float, int, int]]:
    """(cov, row, col) of each valid token of the micro-batch, with its own means."""
    cells = [(i, t) for i in rows for t in range(b["mask"].shape[1]) if b["mask"][i, t]]
    mean_a = sum(float(b["adv"][i, t]) for i, t in cells) / len(cells)
    mean_l = sum(float(b["log_prob"][i, t]) for i, t in cells) / len(cells)
    return [((float(b["adv"][i, t]) - mean_a) * (float(b["log_prob"][i, t]) - mean_l), i, t) for i, t in cells]


def reference(b, mode, rows, *, n_tokens, n_seqs, is_w=True, clip_c=None) -> tuple[float, torch.Tensor]:
    """The micro-batch `rows`' share of the mini-batch loss, from the paper's formula, and its gradient."""
    low, high = CLIPS[mode]
    p = PARAMS
    lp_all = b["log_prob"].clone().requires_grad_(True)
    selected: set[tuple[int, int]] = set()
    if mode in ("clip_cov", "kl_cov"):
        scores = _cov_scores(b, rows)
        if mode == "kl_cov":
            k = max(1, int(len(scores) * p.kl_cov_ratio))
            selected = {(i, t) for _, i, t in sorted(scores, reverse=True)[:k]}
        else:  # clip_cov_ratio = 1: every candidate is cut (no random choice left)
            selected = {(i, t) for c, i, t in scores if p.clip_cov_lb < c < p.clip_cov_ub}
    total = torch.zeros((), dtype=torch.float64)
    for i in rows:
        cols = [t for t in range(b["mask"].shape[1]) if b["mask"][i, t]]
        if not cols:
            continue
        lp = [lp_all[i, t] for t in cols]
        old = [float(b["old"][i, t]) for t in cols]
        a = [float(b["adv"][i, t]) for t in cols]
        w = [float(b["is_w"][i, t]) if is_w else 1.0 for t in cols]
        n = len(cols)
        if mode == "gspo":  # s_i = (pi / pi_old)^(1/|y|); token form sg[s_i] pi / sg[pi]
            s_i = math.exp(sum(float(x) - o for x, o in zip(lp, old, strict=True)) / n)
            seq = 0
            for x, ai, wi in zip(lp, a, w, strict=True):
                s = s_i * torch.exp(x - x.detach())
                seq = seq + wi * torch.maximum(-ai * s, -ai * torch.clamp(s, 1 - low, 1 + high))
            total = total + seq / n / n_seqs
        elif mode == "cispo":  # sum_t sg(clip(r)) A log pi over all tokens
            for x, o, ai, wi in zip(lp, old, a, w, strict=True):
                r_hat = _clip(math.exp(float(x) - o), 1 - low, 1 + high)
                total = total - wi * r_hat * ai * x / n_tokens
        elif mode == "sapo":  # 1/|y| sum_t f(r) A, f(r) = sigmoid(tau (r - 1)) 4 / tau
            seq = 0
            for x, o, ai, wi in zip(lp, old, a, w, strict=True):
                tau = p.tau_pos if ai > 0 else p.tau_neg
                seq = seq - wi * torch.sigmoid(tau * (torch.exp(x - o) - 1)) * 4 / tau * ai
            total = total + seq / n / n_seqs
        elif mode == "geo_mean":  # A (prod_t rho_t')^(1/|o|), rho' = the ratio min(rho A, clip(rho) A) keeps
            a_i = sum(a) / n
            prod = 1
            for x, o in zip(lp, old, strict=True):
                rho = torch.exp(x - o)
                rho_c = torch.clamp(rho, math.exp(-low), math.exp(high))
                prod = prod * (rho if float(rho) * a_i <= float(rho_c) * a_i else rho_c)
            seq_w = math.exp(sum(math.log(v + 1e-10) for v in w) / n)
            total = total - seq_w * a_i * prod ** (1 / n) / n_seqs
        else:  # vanilla / clip_cov / kl_cov: token-level PPO family
            for t, x, o, ai, wi in zip(cols, lp, old, a, w, strict=True):
                r = torch.exp(x - o)
                if mode == "kl_cov":
                    loss = -ai * r + (p.ppo_kl_coef * torch.abs(x - o) if (i, t) in selected else 0)
                else:
                    loss = torch.maximum(-ai * r, -ai * torch.clamp(r, 1 - low, 1 + high))
                    if clip_c is not None and ai < 0:
                        loss = torch.minimum(loss, torch.tensor(-ai * clip_c, dtype=torch.float64))
                    if (i, t) in selected and not -ai * _clip(float(r), 1 - low, 1 + high) > -ai * float(r):
                        loss = loss * 0
                total = total + wi * loss / n_tokens
    total.backward()
    grad = torch.nan_to_num(lp_all.grad)[rows]
    return float(total.detach()), grad


NEW_MODES = [m for m in POLICY_LOSS_MODES if m != "vanilla"]


def _counts(b) -> tuple[int, int]:
    return int(b["mask"].sum()), int(b["mask"].any(-1).sum())


@pytest.mark.parametrize("mode", NEW_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_mode_equals_its_papers_float64_reference(mode, seed):
    b = _batch(seed, empty_row=True)
    n_tokens, n_seqs = _counts(b)
    loss, grad, _ = _ours(b, mode, n_tokens=n_tokens, n_seqs=n_seqs, clip_c=3.0 if mode == "clip_cov" else None)
    ref, ref_grad = reference(b, mode, range(6), n_tokens=n_tokens, n_seqs=n_seqs,
                              clip_c=3.0 if mode == "clip_cov" else None)
    assert float(loss) == pytest.approx(ref, abs=TOL)
    assert torch.allclose(grad, ref_grad, atol=TOL, rtol=0)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("mode", NEW_MODES)
def test_micro_batches_sum_to_the_reference_of_the_mini_batch(mode):
    # Sequences never span micro-batches; the counts are the mini-batch's. For clip_cov/kl_cov
    # the covariance selection is the micro-batch's (cov_modes.py), so is the reference's.
    b = _batch(3, rows=7)
    n_tokens, n_seqs = _counts(b)
    # Two rows at least: in a one-row micro-batch every covariance is 0 (one advantage), a tie.
    parts = [range(0, 3), range(3, 5), range(5, 7)]
    losses, grads, refs, ref_grads = [], [], [], []
    for part in parts:
        loss, grad, _ = _ours(b, mode, slice(part.start, part.stop), n_tokens=n_tokens, n_seqs=n_seqs)
        ref, ref_grad = reference(b, mode, part, n_tokens=n_tokens, n_seqs=n_seqs)
        losses.append(float(loss)), grads.append(grad), refs.append(ref), ref_grads.append(ref_grad)
    assert sum(losses) == pytest.approx(sum(refs), abs=TOL)
    assert torch.allclose(torch.cat(grads), torch.cat(ref_grads), atol=TOL, rtol=0)
    if mode not in ("clip_cov", "kl_cov"):  # the whole batch at once gives the same loss
        whole, _, _ = _ours(b, mode, n_tokens=n_tokens, n_seqs=n_seqs)
        assert float(whole) == pytest.approx(sum(losses), abs=1e-12)


# ----------------------------------------------------------------------------- verl 0.9.1


@pytest.fixture(scope="module")
def verl():
    return load_core_algos()


def _verl(core, b, mode, rows, *, n_tokens, n_seqs, seed=0):
    low, high = CLIPS[mode]
    cfg = ActorConfig(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0, tau_pos=PARAMS.tau_pos,
                      tau_neg=PARAMS.tau_neg,
                      policy_loss={"clip_cov_ratio": PARAMS.clip_cov_ratio, "clip_cov_lb": PARAMS.clip_cov_lb,
                                   "clip_cov_ub": PARAMS.clip_cov_ub, "kl_cov_ratio": PARAMS.kl_cov_ratio,
                                   "ppo_kl_coef": PARAMS.ppo_kl_coef},
                      global_batch_info={"dp_size": 1, "batch_num_tokens": n_tokens, "global_batch_size": n_seqs})
    mask = b["mask"][rows].double()
    lp = torch.where(b["mask"][rows], b["log_prob"][rows], 0.0).clone().requires_grad_(True)
    torch.manual_seed(seed)  # clip_cov's torch.randperm draws from the global generator
    loss, metrics = core.POLICY_LOSS_REGISTRY[mode](
        b["old"][rows], lp, b["adv"][rows], mask, LOSS_MODE_SPECS[mode].agg_modes[0], cfg, b["is_w"][rows])
    if mode == "geo_mean":  # verl takes the plain mean over the micro-batch's rows
        loss = loss * mask.shape[0] / n_seqs
    loss.backward()
    return loss, lp.grad, metrics


@pytest.mark.parametrize("mode", list(POLICY_LOSS_MODES))
@pytest.mark.parametrize("split", [False, True], ids=["whole", "micro-batches"])
def test_mode_equals_verls_function(verl, mode, split):
    b = _batch(7, rows=8)
    n_tokens, n_seqs = _counts(b)
    parts = [slice(0, 3), slice(3, 5), slice(5, 8)] if split else [slice(0, 8)]
    for k, part in enumerate(parts):
        clip_c = 3.0 if mode == "vanilla" else None  # verl's vanilla always dual-clips, its clip_cov never
        loss, grad, metrics = _ours(b, mode, part, n_tokens=n_tokens, n_seqs=n_seqs, seed=k, clip_c=clip_c)
        v_loss, v_grad, v_metrics = _verl(verl, b, mode, part, n_tokens=n_tokens, n_seqs=n_seqs, seed=k)
        assert float(loss) == pytest.approx(float(v_loss), abs=TOL), part
        assert torch.allclose(grad, v_grad, atol=TOL, rtol=0), part
        if mode in ("vanilla", "cispo", "geo_mean") and not split:  # verl's local token means = ours unsplit
            assert float(metrics["pg_clipfrac"]) == pytest.approx(v_metrics["actor/pg_clipfrac"], abs=TOL)
            assert float(metrics["ppo_kl"]) == pytest.approx(v_metrics["actor/ppo_kl"], abs=TOL)
        if mode == "clip_cov" and not split:  # verl calls the cut tokens its pg_clipfrac
            assert float(metrics["cov_selected_frac"]) == pytest.approx(v_metrics["actor/pg_clipfrac"], abs=TOL)


def test_clip_cov_draws_its_share_at_random_from_the_candidates(verl):
    # clip_cov_ratio below the candidates' share: verl's random choice (same seed, same draw) is ours.
    b = _batch(11, rows=8, width=16)
    n_tokens, n_seqs = _counts(b)
    global PARAMS
    saved, PARAMS = PARAMS, ModeParams(clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=5.0)
    try:
        for seed in (0, 1, 2):
            loss, grad, metrics = _ours(b, "clip_cov", n_tokens=n_tokens, n_seqs=n_seqs, seed=seed)
            v_loss, v_grad, _ = _verl(verl, b, "clip_cov", slice(None), n_tokens=n_tokens, n_seqs=n_seqs,
                                      seed=seed)
            assert float(loss) == pytest.approx(float(v_loss), abs=TOL)
            assert torch.allclose(grad, v_grad, atol=TOL, rtol=0)
            assert float(metrics["cov_selected_frac"]) * n_tokens == int(0.05 * n_tokens)
    finally:
        PARAMS = saved


def test_gspo_metrics_are_per_sequence():
    b = _batch(5)
    n_tokens, n_seqs = _counts(b)
    _, _, metrics = _ours(b, "gspo", n_tokens=n_tokens, n_seqs=n_seqs)
    s = [math.exp(float(((b["log_prob"][i] - b["old"][i])[b["mask"][i]]).mean())) for i in range(6)]
    low, high = CLIPS["gspo"]
    clipped = [(si > 1 + high and float(b["adv"][i, 0]) > 0) or (si < 1 - low and float(b["adv"][i, 0]) < 0)
               for i, si in enumerate(s)]
    assert float(metrics["seq_ratio"]) == pytest.approx(sum(s) / 6, abs=1e-12)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(sum(clipped) / 6, abs=1e-12)
    assert 0 < sum(clipped) < 6


def test_registry_and_config_name_the_same_modes():
    assert list(POLICY_LOSS_MODES) == list(LOSS_MODE_SPECS)
    for name, mode in POLICY_LOSS_MODES.items():
        assert mode.clips == (LOSS_MODE_SPECS[name].clip_ratio_low is not None), name


def test_design_md_table_states_each_modes_defaults_and_metrics():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md").read_text()
    section = text.split("### The policy-loss modes", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in POLICY_LOSS_MODES:
            rows[cells[0]] = cells
    assert list(rows) == list(POLICY_LOSS_MODES)
    for name, (_, low, high, agg, metrics) in rows.items():
        spec = LOSS_MODE_SPECS[name]
        as_doc = [f"{v:g}" if v is not None else "-" for v in (spec.clip_ratio_low, spec.clip_ratio_high)]
        assert [f"{float(v):g}" if v != "-" else v for v in (low, high)] == as_doc, name
        assert agg == spec.agg_modes[0], name
        assert [m.strip() for m in metrics.split(",")] == list(POLICY_LOSS_MODES[name].metrics), name


def test_the_guides_objectives_page_states_each_modes_aggregations_and_clip():
    """docs/guide/objectives.md quotes each mode's allowed aggregations (the default first) and
    clip defaults: held to the config's LOSS_MODE_SPECS, as the DESIGN.md table is."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "objectives.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].strip("`") in POLICY_LOSS_MODES:
            rows[cells[0].strip("`")] = cells
    assert list(rows) == list(POLICY_LOSS_MODES)
    for name, (_, _, aggs, clip, _) in rows.items():
        spec = LOSS_MODE_SPECS[name]
        assert [a.strip().strip("`") for a in aggs.split(",")] == list(spec.agg_modes), name
        low, high = (c.strip() for c in clip.split("/"))
        as_doc = [f"{v:g}" if v is not None else "-" for v in (spec.clip_ratio_low, spec.clip_ratio_high)]
        assert [f"{float(v):g}" if v != "-" else v for v in (low, high)] == as_doc, name
