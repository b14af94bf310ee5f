"""tools/ablate.py: the equal-token-budget cut and the per-seed spread it reports."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ablate", REPO / "tools" / "ablate.py")
ablate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ablate)


def rows(tokens_per_step, accs):
    """Step 0 has an evaluation and no generation; step i generates tokens_per_step[i-1]."""
    out = [{"step": 0, "val/acc": accs[0]}]
    for i, t in enumerate(tokens_per_step, start=1):
        out.append({"step": i, "train/num_generated_tokens": t, "val/acc": accs[i] if i < len(accs) else None})
    return out


def test_cut_at_budget_stops_at_the_step_that_reaches_it():
    grpo = rows([100, 100, 100, 100], [0.3, 0.35, 0.4, 0.45, 0.5])
    kept, reached = ablate.cut_at_budget(grpo, 250)
    assert [r["step"] for r in kept] == [0, 1, 2, 3] and reached
    s = ablate.summarize(kept)
    assert s["val_last"] == 0.45 and s["gen_tokens"] == 300 and s["gain_points"] == pytest.approx(15.0)
    kept, reached = ablate.cut_at_budget(grpo, 10_000)
    assert len(kept) == 5 and not reached


def test_aggregate_and_table_give_mean_min_max_over_seeds(tmp_path):
    per_seed = [ablate.summarize(rows([10], [0.30, 0.55])), ablate.summarize(rows([20], [0.35, 0.50]))]
    agg = ablate.aggregate(per_seed)
    assert agg["gain_points"] == pytest.approx((20.0, 15.0, 25.0))
    assert agg["val_first"] == pytest.approx((0.325, 0.30, 0.35))
    table = ablate.write_table({"DAPO": [(1, per_seed[0], 100.0, True), (2, per_seed[1], 120.0, True)]},
                               tmp_path / "t.md")
    assert "| DAPO | 1 | 0.300 | 0.550 | 0.550 | +25.0 |" in table
    assert "| **DAPO: mean [min, max]** | 2 seeds | 0.325 [0.300, 0.350] |" in table
