"""The DAPO trainer end to end: single process, TP=2 and PP=2, on CPU."""

import pytest
from trained_samples import check_run_records
from trainer_utils import read_rows, run_trainer, write_config

from megatron_dapo.collect.trained import TRAINED_SAMPLES_ENV

pytestmark = pytest.mark.e2e

TRAIN_KEYS = [
    "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "response_length/mean",
    "response_length/clip_ratio", "train/num_gen_batches", "train/num_groups", "train/num_responses",
    "train/kept_group_acc_min", "train/kept_group_acc_max", "actor/pg_loss", "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "rollout/train_logprob_abs_diff", "timing_s/gen", "timing_s/reward", "timing_s/collect", "timing_s/old_log_prob", "timing_s/update_actor",
    "timing_s/sync", "timing_s/step", "perf/throughput_tokens_per_s", "reward/num_errors", "timing_s/fill",
    "rollout/aborted_tokens", "rollout/generated_tokens_per_kept_group",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize(
    ("nproc", "overrides"),
    # TP=2 runs the same invariants in tests/e2e/test_async.py (k1-tp2) and with R3 in
    # test_routing_replay_train.py; its own run here cost CI 36 s.
    [(1, ()), (1, ("algorithm.filter_groups.mode=rounds",)), (2, ("parallel.pipeline_model_parallel_size=2",))],
    ids=["single", "rounds", "pp2"],
)
def test_few_steps_hold_the_dapo_invariants(tmp_path, cache_dir, nproc, overrides):
    out = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml")
    proc = run_trainer(config, f"trainer.output_dir={out}", *overrides, cache_dir=cache_dir, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val/acc" in rows[0] and "val/acc" in rows[2]
    for row in rows[1:]:
        missing = [k for k in TRAIN_KEYS if k not in row]
        assert not missing, missing
        # Dynamic sampling: every kept group has 0 < accuracy < 1, the batch is exactly full.
        assert 0 < row["train/kept_group_acc_min"] <= row["train/kept_group_acc_max"] < 1
        assert row["train/num_groups"] == 4 and row["train/num_responses"] == 16
        # The engine's log-probs are the actor's own after every weight sync (fp32).
        assert row["rollout/train_logprob_abs_diff"] < 1e-4
        assert row["actor/lr"] == pytest.approx(1e-3)
    # The console shows the invariants too (kept groups and batch size per step).
    assert "gen_rounds" in proc.stdout and "responses 16" in proc.stdout and "kept_acc_min" in proc.stdout
    assert (out / "checkpoints" / "step_2" / "manifest.json").is_file()


def test_bad_config_exits_2_with_one_line(tmp_path, cache_dir):
    config = write_config(tmp_path / "tiny.yaml")
    proc = run_trainer(config, "algorithm.clip_ratio_hgh=0.3", cache_dir=cache_dir)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: command line: algorithm.clip_ratio_hgh: unknown key; did you mean 'algorithm.clip_ratio_high'?")


@pytest.mark.parametrize(("mode", "how"), [("rounds", "after 2 generation rounds"), ("streaming", "from 16 prompts")])
def test_unfillable_batch_stops_with_a_clear_error(tmp_path, cache_dir, mode, how):
    # The math verifier on a random-init model: every group all-wrong, so no batch fills.
    config = write_config(tmp_path / "tiny.yaml", reward={"reward_fn": "math_dapo", "num_workers": 0},
                          algorithm={"filter_groups": {"enable": True, "max_num_gen_batches": 2, "mode": mode}})
    proc = run_trainer(config, f"trainer.output_dir={tmp_path / 'run'}", "trainer.val_before_train=false",
                       cache_dir=cache_dir)
    assert proc.returncode == 3
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: dynamic sampling kept 0 of the 4 groups a training batch needs {how}")
    assert "16 all-wrong" in last


def test_one_update_per_step_skips_the_old_log_prob_pass(tmp_path, cache_dir):
    # ppo_mini_batch_size == train_batch_size, one epoch: the update's own forward supplies
    # the old log-probs, so the first (only) update of each step is exactly on-policy.
    out = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml")
    # The same run checks the lr decay's wiring: linear from 1e-3 at update 0 to 0.5e-3 at the
    # run's last optimizer step (2 here), so update 1 runs at 0.75e-3.
    proc = run_trainer(config, f"trainer.output_dir={out}", "trainer.ppo_mini_batch_size=4",
                       "trainer.val_before_train=false", "trainer.test_freq=0", "optim.lr_warmup_steps=0",
                       "optim.lr_decay_style=linear", "optim.min_lr_ratio=0.5", cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["actor/lr"] for r in rows] == pytest.approx([1e-3, 0.75e-3])
    for row in rows:
        assert "timing_s/old_log_prob" not in row
        assert row["actor/ppo_kl"] == 0.0
        assert row["actor/pg_clipfrac"] == 0.0 and row["actor/pg_clipfrac_lower"] == 0.0
        # The drift metric now compares the engine with the update's own forward pass.
        assert row["rollout/train_logprob_abs_diff"] < 1e-4


def test_kl_loss_against_the_frozen_reference_starts_at_zero(tmp_path, cache_dir):
    # One update per step: step 1's update sees the starting weights, so its KL is exactly 0.
    out = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml",
                          algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl",
                                     "filter_groups": {"enable": True, "max_num_gen_batches": 6}})
    # The same run checks the lr decay's wiring: linear from 1e-3 at update 0 to 0.5e-3 at the
    # run's last optimizer step (2 here), so update 1 runs at 0.75e-3.
    proc = run_trainer(config, f"trainer.output_dir={out}", "trainer.ppo_mini_batch_size=4",
                       "trainer.val_before_train=false", "trainer.test_freq=0", "optim.lr_warmup_steps=0",
                       "optim.lr_decay_style=linear", "optim.min_lr_ratio=0.5", cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["actor/lr"] for r in rows] == pytest.approx([1e-3, 0.75e-3])
    assert rows[0]["actor/kl_loss"] == 0.0
    assert rows[1]["actor/kl_loss"] > 0.0
    assert all(r["timing_s/ref"] > 0 for r in rows)


def test_partial_rollouts_are_continued_and_survive_a_resume(tmp_path, cache_dir):
    # The trainer's wiring of partial rollouts: the carry goes into the checkpoint's trainer state,
    # so stopping after step 2 and resuming gives step 3 exactly. A scratch model runs every
    # response to the length cap, so its groups finish together and nothing would be carried: 40
    # SFT steps teach it to stop at different lengths (up to ~30 tokens, under a cap of 48 none
    # reaches), and a batch of 2 groups then fills with groups in flight. The schedule depends on token counts only (one engine, in
    # process, seeded), so the carry after step 2 that the resume must restore is there on every run.
    # The same run records every trained sample and checks it against a recomputation
    # (tests/trained_samples.py): rewards reach their own responses across carries.
    config = write_config(tmp_path / "tiny.yaml", rollout={"engine": "local", "n": 4, "val_kwargs": {"n": 2},
                                                           "partial_rollout": True},
                          reward={"reward_fn": "e2e_reward_fns:char_code_score", "num_workers": 1,
                                  "overlong_buffer": {"enable": True, "len": 4}})
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = ("trainer.test_freq=0", "trainer.val_before_train=false", "data.train_batch_size=2",
              "data.max_prompt_length=64", "data.max_response_length=48", "model.scratch.max_position_embeddings=128",
              "data.embedded.num_sft=200",
              "model.sft_warm_start.enable=true", "model.sft_warm_start.num_steps=40",
              "model.sft_warm_start.batch_size=16", "model.sft_warm_start.lr=3.0e-3")
    record = tmp_path / "trained.jsonl"
    proc = run_trainer(config, f"trainer.output_dir={whole}", "trainer.total_training_steps=3", *common,
                       cache_dir=cache_dir, env={TRAINED_SAMPLES_ENV: str(record)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(whole)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["train/num_groups"] == 2 and row["train/num_responses"] == 8
        assert 0 < row["train/kept_group_acc_min"] <= row["train/kept_group_acc_max"] < 1
        assert row["rollout/max_versions_per_response"] <= 2
    # Step 2 leaves groups in flight: the resume after it has a carry to restore, which step 3
    # continues first (whether one of them is kept in its batch is the filter's: not asserted).
    assert rows[1]["rollout/carried_groups"] > 0 and rows[1]["rollout/carried_tokens"] > 0, rows[1]
    assert check_run_records(record, whole / "checkpoints" / "step_3" / "hf", n=4, num_groups=2,
                             max_response_length=48, overlong=(4, 1.0)) == 3 * 2 * 4
    for steps in (2, 3):
        proc = run_trainer(config, f"trainer.output_dir={split}", f"trainer.total_training_steps={steps}", *common,
                           cache_dir=cache_dir)
        assert proc.returncode == 0, proc.stderr[-4000:]
    again = read_rows(split)

    def same(row):
        return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/"))}

    assert [same(r) for r in again] == [same(r) for r in rows]


def test_a_sequence_level_loss_mode_trains(tmp_path, cache_dir):
    # GSPO through the whole trainer: config -> LossSettings -> the actor's train step, with two
    # updates per step (an old-log-prob pass), its sequence-level metrics logged by name.
    out = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml")
    proc = run_trainer(config, f"trainer.output_dir={out}", "algorithm.policy_loss.loss_mode=gspo",
                       "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0",
                       cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1]
    for row in rows:
        assert "actor/pg_clipfrac_lower" not in row  # vanilla's dual clip is not GSPO's
        assert row["actor/seq_ratio"] > 0 and 0 <= row["actor/pg_clipfrac"] <= 1
        assert row["timing_s/old_log_prob"] > 0 and row["actor/grad_norm"] > 0
