"""tools/ablate.py: the equal-token-budget cut and the per-seed spread it reports."""

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ablate", REPO / "tools" / "ablate.py")
ablate = importlib.util.module_from_spec(spec)
sys.modules["ablate"] = ablate  # its dataclasses look their module up
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


def test_paired_lead_gives_the_student_t_interval_and_the_sign_test():
    p = ablate.paired_lead([2.0, 4.0, -1.0, 3.0])
    half = 3.182 * statistics.stdev([2.0, 4.0, -1.0, 3.0]) / 2  # t(0.975, df 3) x sd / sqrt(4)
    assert p["mean"] == pytest.approx(2.0) and p["low"] == pytest.approx(2.0 - half)
    assert p["high"] == pytest.approx(2.0 + half) and (p["wins"], p["losses"]) == (3, 1)
    assert p["sign_p"] == pytest.approx(2 * 5 / 16)  # P(<= 1 loss of 4 fair coins), two-sided
    assert ablate.paired_lead([1.0] * 8)["sign_p"] == pytest.approx(2 / 256)


def test_table_reports_each_runs_paired_lead_against_the_first(tmp_path):
    dapo = [(s, ablate.summarize(rows([10], [0.3, last])), 1.0, True) for s, last in ((1, 0.6), (2, 0.55), (3, 0.5))]
    grpo = [(s, ablate.summarize(rows([10], [0.3, last])), 1.0, True) for s, last in ((1, 0.54), (2, 0.5), (3, 0.45))]
    table = ablate.write_table({"DAPO": dapo, "GRPO": grpo}, tmp_path / "t.md")
    lead = [line for line in table.splitlines() if line.startswith("| GRPO | generated tokens | 3 | +")]
    assert lead == ["| GRPO | generated tokens | 3 | +5.3 | [+3.9, +6.8] | 3 / 0 | 0.250 | yes |"]  # 6, 5, 5 points
    steps = ablate.write_table({"DAPO": dapo, "GRPO": grpo}, tmp_path / "t.md", "RL steps")
    assert "| GRPO | RL steps | 3 | +5.3 | [+3.9, +6.8] | 3 / 0 | 0.250 | yes |" in steps


class _FakeTrainer:
    """Stands in for the training process: each poll appends one step of 100 generated tokens."""

    def __init__(self, argv, cwd, env, stdout, stderr):
        self.out = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("trainer.output_dir=")))
        self.steps, self.terminated, self.returncode = 0, False, None

    def poll(self):
        if self.terminated or self.steps >= 10:
            self.returncode = 0
            return 0
        self.steps += 1
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": self.steps, "train/num_generated_tokens": 100}) + "\n")
        return None

    def terminate(self):
        self.terminated = True

    def wait(self):
        return 0


def test_run_one_stops_the_run_once_it_has_generated_the_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(ablate.subprocess, "Popen", _FakeTrainer)
    monkeypatch.setattr(ablate.time, "sleep", lambda s: None)
    ablate.run_one(ablate.RUNS["grpo"], tmp_path / "g", 1, 30, [], budget=350)
    assert ablate.generated_tokens(ablate.read_rows(tmp_path / "g")) == 400  # stopped at the 4th step
    ablate.run_one(ablate.RUNS["grpo"], tmp_path / "h", 1, 30, [], budget=None)
    assert ablate.generated_tokens(ablate.read_rows(tmp_path / "h")) == 1000  # ran to its end


def test_component_runs_differ_from_dapo_in_one_setting_each():
    for name in ("no-clip-higher", "token-mean-off", "no-overlong"):
        assert ablate.RUNS[name].config == ablate.DAPO_CONFIG and len(ablate.RUNS[name].overrides) == 1
    assert ablate.RUNS["no-dynamic-sampling"].overrides[0] == "algorithm.filter_groups.enable=false"


def test_a_run_that_ended_with_the_same_command_is_reused_not_rerun(tmp_path, monkeypatch):
    started = []

    class Counting(_FakeTrainer):
        def __init__(self, *args, **kwargs):
            started.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ablate.subprocess, "Popen", Counting)
    monkeypatch.setattr(ablate.time, "sleep", lambda s: None)
    wall = ablate.run_one(ablate.RUNS["dapo"], tmp_path / "d", 1, 30, [])
    assert ablate.run_one(ablate.RUNS["dapo"], tmp_path / "d", 1, 30, []) == wall and len(started) == 1
    # Another budget, step count or override is another run.
    ablate.run_one(ablate.RUNS["dapo"], tmp_path / "d", 1, 30, [], budget=350)
    ablate.run_one(ablate.RUNS["dapo"], tmp_path / "d", 1, 30, ["optim.lr=1e-3"], budget=350)
    assert len(started) == 3


@pytest.mark.parametrize("equal", ["tokens", "steps"])
def test_the_other_run_is_matched_on_dapos_tokens_or_on_its_steps(tmp_path, monkeypatch, equal):
    """Tokens: GRPO may take 3x DAPO's steps and stops at DAPO's tokens. Steps: GRPO trains exactly
    DAPO's steps with no budget, so its lr schedule ends where DAPO's does (never cut mid-decay),
    into a directory of its own (a token-budget run of the same seed is kept)."""
    monkeypatch.setattr(ablate.subprocess, "Popen", _FakeTrainer)
    monkeypatch.setattr(ablate.time, "sleep", lambda s: None)
    args = argparse.Namespace(steps=4, steps_factor=3.0, out=tmp_path, overrides=[], equal=equal)
    runs = ablate.run_seed(7, ["dapo", "grpo"], args, None)
    grpo_dir = tmp_path / ("grpo_seed7" if equal == "tokens" else "grpo_seed7_steps")
    record = json.loads((grpo_dir / ablate.DONE).read_text())
    if equal == "tokens":
        assert record["budget"] == 1000 and "trainer.total_training_steps=12" in record["overrides"]
    else:
        assert record["budget"] is None and "trainer.total_training_steps=4" in record["overrides"]
    assert [kind for kind, *_ in runs] == ["dapo", "grpo"]
