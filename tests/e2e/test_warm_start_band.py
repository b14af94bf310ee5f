"""The SFT warm start that stops on a held-out accuracy band, and its cache key."""

import json

import pytest
from trainer_utils import read_rows, run_trainer, write_config

pytestmark = pytest.mark.e2e

SFT = {"sft_warm_start": {"enable": True, "num_steps": 10, "batch_size": 8, "lr": 3.0e-3, "check_interval": 5}}


def warm_start_record(cache_dir):
    (record,) = cache_dir.glob("sft-*/warm_start.json")
    return json.loads(record.read_text())


def heldout_of(hf_dir, config, cache_dir) -> dict[str, float]:
    """The val/* metrics the trainer's step-0 validation gives the weights in `hf_dir` (same prompts,
    sampling, seed, reward and engine: the in-process local engine)."""
    from megatron_dapo.collect import score_heldout, val_sampling_params
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.data.datasets import load_prompt_dataset
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.embedded import task_of
    from megatron_dapo.rewards.pool import RewardPool
    from megatron_dapo.rollout.controller import RolloutController
    from megatron_dapo.rollout.local.engine import LocalEngine

    cfg = load_config(config, [])
    task = task_of(cfg, cache_dir)
    tokenizer = load_tokenizer(str(task.tokenizer_path))
    prompts = load_prompt_dataset(str(task.val_path), tokenizer, cfg.data.max_prompt_length).records
    rollout = RolloutController([LocalEngine(hf_dir, name="local0")])
    rewards = RewardPool(cfg.reward.reward_fn, 0, cfg.reward.timeout_s)
    try:
        params = val_sampling_params(cfg.rollout.val_kwargs, max_new_tokens=cfg.data.max_response_length,
                                     eos_id=tokenizer.eos_id, seed=cfg.trainer.seed)
        return score_heldout(prompts, rollout=rollout, rewards=rewards, tokenizer=tokenizer, params=params)
    finally:
        rewards.close()
        rollout.shutdown()


def test_band_stops_at_the_first_check_inside_it_and_rl_starts_from_its_weights(tmp_path):
    cache_dir, run_dir = tmp_path / "cache", tmp_path / "run"
    model = {**SFT, "sft_warm_start": {**SFT["sft_warm_start"], "target_acc_min": 0.0, "target_acc_max": 1.0}}
    config = write_config(tmp_path / "tiny.yaml", model=model)
    proc = run_trainer(config, f"trainer.output_dir={run_dir}", "trainer.total_training_steps=1", cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = warm_start_record(cache_dir)
    assert record["steps"] == 5 and record["chosen_step"] == 5 and [c["step"] for c in record["checks"]] == [5]
    # RL starts from the chosen weights: its step-0 validation (a draw of its own, since the check
    # was selected for its reading: tests/unit/test_heldout_draws.py) is exactly what the cached
    # checkpoint scores with the trainer's validation draw, recomputed here; the scratch weights
    # it started SFT from score otherwise.
    row = read_rows(run_dir)[0]
    assert row["step"] == 0
    chosen = next(cache_dir.glob("sft-*/warm_start.json")).parent
    assert {k: v for k, v in row.items() if k.startswith("val/")} == heldout_of(chosen, config, cache_dir)
    assert heldout_of(next(cache_dir.glob("scratch-*/config.json")).parent, config, cache_dir)["val/response_length/mean"] \
        != row["val/response_length/mean"]
    assert "held-out acc" in proc.stderr

    # An unreachable band runs every step and keeps the check nearest to it, with a warning;
    # the band is part of the cache key, so this is a new warm start, not the cached one.
    model["sft_warm_start"].update(target_acc_min=1.0, target_acc_max=1.0)
    config = write_config(tmp_path / "tiny2.yaml", model=model)
    proc = run_trainer(config, f"trainer.output_dir={tmp_path / 'run2'}", "trainer.total_training_steps=1",
                       cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (second,) = [p for p in cache_dir.glob("sft-*/warm_start.json") if json.loads(p.read_text())["band"] == [1.0, 1.0]]
    record = json.loads(second.read_text())
    assert record["steps"] == 10 and [c["step"] for c in record["checks"]] == [5, 10]
    best = max(record["checks"], key=lambda c: c["acc"])
    assert record["chosen_step"] == best["step"]
    assert "no check landed in the target band" in proc.stderr


def test_band_check_at_tp2(tmp_path):
    # The check's weight export is collective: every rank of the TP group takes part and
    # every rank gets the controller's decision.
    cache_dir, run_dir = tmp_path / "cache", tmp_path / "run"
    model = {**SFT, "sft_warm_start": {**SFT["sft_warm_start"], "target_acc_min": 0.0, "target_acc_max": 1.0}}
    config = write_config(tmp_path / "tiny.yaml", model=model)
    proc = run_trainer(config, f"trainer.output_dir={run_dir}", "trainer.total_training_steps=1",
                       "parallel.tensor_model_parallel_size=2", cache_dir=cache_dir, nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = warm_start_record(cache_dir)
    assert record["chosen_step"] == 5 and record["steps"] == 5


def test_checks_come_every_fine_interval_once_one_reads_half_the_band(tmp_path):
    # even_answer scores the prompts, not the model: every check reads the share of even answers
    # in the held-out split, v. A band starting above v but at most 2v is never reached, and
    # every check after the first is "near" it, so they come every fine_check_interval steps.
    cache_dir = tmp_path / "cache"
    sft = {**SFT["sft_warm_start"], "target_acc_min": 0.0, "target_acc_max": 1.0, "fine_check_interval": 2}
    reward = {"reward_fn": "e2e_reward_fns:even_answer"}
    # A group's responses all score alike here, so dynamic sampling would keep none: it is off.
    algorithm = {"filter_groups": {"enable": False}}
    config = write_config(tmp_path / "tiny.yaml", model={"sft_warm_start": sft}, reward=reward, algorithm=algorithm)
    proc = run_trainer(config, f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_training_steps=1",
                       "trainer.val_before_train=false", cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    v = warm_start_record(cache_dir)["checks"][0]["acc"]
    assert 0 < v < 1
    sft.update(target_acc_min=min(1.0, 1.5 * v), target_acc_max=1.0)
    config = write_config(tmp_path / "tiny2.yaml", model={"sft_warm_start": sft}, reward=reward, algorithm=algorithm)
    proc = run_trainer(config, f"trainer.output_dir={tmp_path / 'run2'}", "trainer.total_training_steps=1",
                       "trainer.val_before_train=false", cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (record,) = [json.loads(p.read_text()) for p in cache_dir.glob("sft-*/warm_start.json")
                 if json.loads(p.read_text())["band"][0] > 0]
    assert [c["step"] for c in record["checks"]] == [5, 7, 9, 10]
    assert all(c["acc"] == v for c in record["checks"])


def test_band_by_kind_reads_the_weakest_kinds_accuracy(tmp_path):
    # Issue 63: a band on the mean stopped the tool example's SFT with one skill learnt and the
    # other absent. With band_by_kind the check reads the lowest per-kind avg@n; even_answer scores
    # the prompts, so each kind's reading is the share of even answers among its held-out prompts.
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.embedded import task_of

    cache_dir = tmp_path / "cache"
    sft = {**SFT["sft_warm_start"], "target_acc_min": 0.0, "target_acc_max": 1.0, "band_by_kind": True}
    config = write_config(tmp_path / "tiny.yaml", model={"sft_warm_start": sft},
                          reward={"reward_fn": "e2e_reward_fns:even_answer"}, algorithm={"filter_groups": {"enable": False}})
    proc = run_trainer(config, f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_training_steps=1",
                       "trainer.val_before_train=false", cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in task_of(load_config(config, []), cache_dir)
            .val_path.read_text().splitlines()]
    by_kind: dict[str, list[bool]] = {}
    for r in rows:
        by_kind.setdefault(r["extra_info"]["kind"], []).append(int(r["answer"]) % 2 == 0)
    shares = {kind: sum(v) / len(v) for kind, v in by_kind.items()}
    overall = sum(sum(v) for v in by_kind.values()) / len(rows)
    assert len(shares) >= 2 and min(shares.values()) < overall
    record = warm_start_record(cache_dir)
    assert record["chosen_step"] == 5 and record["checks"][0]["acc"] == pytest.approx(min(shares.values()), abs=1e-9)
    assert "held-out acc of the weakest kind" in proc.stderr and "by kind" in proc.stderr
