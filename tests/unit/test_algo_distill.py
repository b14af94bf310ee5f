"""On-policy distillation: the reverse-KL advantage (algo/distill.py), its config rules and its cost in `plan`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_dapo.algo.distill import distill_advantages
from megatron_dapo.config.loader import load_config
from megatron_dapo.plan import GPUS, make_plan, resolve_model

REPO = Path(__file__).resolve().parents[2]


def test_reverse_kl_enters_each_policy_token_as_a_negative_advantage():
    adv = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, -2.0, -2.0, 0.0]])
    student = torch.tensor([[0.0, -0.5, -1.0, -3.0], [0.0, -0.2, -4.0, 0.0]])
    teacher = torch.tensor([[0.0, -0.1, -2.0, -9.0], [0.0, -0.2, -1.0, 0.0]])
    # Row 0: token 3 is a tool's output (not a policy token); row 1: token 3 is padding.
    mask = torch.tensor([[False, True, True, False], [False, True, True, False]])
    out, sums = distill_advantages(adv, student, teacher, mask, coef=0.5, reward_weight=2.0)
    # 2 x A - 0.5 x (log pi_s - log pi_T) on the policy tokens, 0 elsewhere (the tool token too).
    expected = torch.tensor([[0.0, 2 - 0.5 * -0.4, 2 - 0.5 * 1.0, 0.0], [0.0, -4 - 0.0, -4 - 0.5 * -3.0, 0.0]])
    assert torch.allclose(out, expected, atol=1e-6)
    # Sums of the metrics: reverse KL -0.4 + 1.0 + 0.0 - 3.0, teacher -0.1 - 2.0 - 0.2 - 1.0, 4 tokens.
    assert sums.tolist() == pytest.approx([-2.4, -3.3, 4.0])
    pure, _ = distill_advantages(adv, student, teacher, mask, coef=1.0, reward_weight=0.0)
    assert torch.allclose(pure[mask], (teacher - student)[mask])


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm.distill.coef=0"], "algorithm.distill.coef=0: must be > 0"),
    (["algorithm.distill.reward_weight=-1"], "algorithm.distill.reward_weight=-1: must be >= 0"),
    (["algorithm.distill.teacher=/nowhere"],
     "algorithm.distill.reward_weight: trains on the teacher's signal alone (0), but dynamic sampling"),
])
def test_bad_distill_settings_are_one_line(overrides, message):
    from megatron_dapo.config import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(REPO / "examples" / "tiny_cpu.yaml", overrides)


def test_the_teacher_must_be_an_hf_checkpoint_with_the_students_tokenizer(tmp_path):
    from megatron_dapo.config.preflight import check_teacher
    from megatron_dapo.errors import UserError

    ckpt = tmp_path / "step_5"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text("{}")
    cfg = load_config(REPO / "examples" / "tiny_cpu.yaml",
                      [f"algorithm.distill.teacher={ckpt}", "algorithm.filter_groups.enable=false"])
    with pytest.raises(UserError, match=r"is a training checkpoint; export its weights first \(megatron-dapo convert "
                                        r"mcore-to-hf\)"):
        check_teacher(cfg, None)


def test_plan_counts_the_teachers_forward(tmp_path):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    shutil.copy(REPO / "examples" / "model_configs" / "Qwen2.5-32B.json", teacher / "config.json")
    base = ["trainer.nnodes=4"]
    distil = [*base, f"algorithm.distill.teacher={teacher}", "algorithm.filter_groups.enable=false"]
    plans = {}
    for name, overrides in (("dapo", base), ("distil", distil)):
        cfg = load_config(REPO / "examples" / "dapo_qwen2.5_7b.yaml", overrides)
        plans[name] = make_plan(cfg, resolve_model(cfg), nodes=4, gpus_per_node=8, hardware=GPUS["h100"])
    lines = {line.label: line for line in plans["distil"].timing}
    assert "teacher log-probs" not in {line.label for line in plans["dapo"].timing}
    t = plans["distil"].teacher
    assert t is not None and 31e9 < t.num_params() < 34e9
    extra = plans["distil"].step_seconds - plans["dapo"].step_seconds
    assert extra == pytest.approx(lines["teacher log-probs"].value, rel=1e-9) and extra > 0
    # 2 x N_teacher FLOPs per token, against the student's 2 x N for its old log-probs.
    tokens_s = lines["teacher log-probs"].value / (2 * t.num_params())
    assert tokens_s == pytest.approx(lines["old/ref log-probs"].value
                                     / (2 * plans["dapo"].num_params * float(lines["old/ref log-probs"].formula.split()[0])),
                                     rel=1e-9)
