"""The asynchronous loop end to end: the engine in its own process, generating ahead of the actor.

A run with trainer.max_staleness keeps every DAPO invariant, logs the staleness of every
batch within the bound, and a kill -9 while the producer has drawn ahead, then the same
command again, neither loses nor repeats a step or a prompt.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
from trained_samples import check_run_records
from trainer_utils import (
    REPO,
    kill_main_when,
    read_rows,
    run_processes,
    run_trainer,
    train_command,
    trainer_env,
    write_config,
)

from megatron_dapo.collect.trained import TRAINED_SAMPLES_ENV

pytestmark = pytest.mark.e2e

ASYNC = ("rollout.placement=disaggregated", "trainer.test_freq=2")
# An engine killed mid-run in the asynchronous loop costs a restart, not the run: held by the vLLM
# fleet's trainer run (tests/vllm_cpu/test_vllm_train.py, a real server killed after step 1) and,
# for the local engine's process, tests/unit/test_engine_restart.py (this run cost CI 42 s).


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize(("max_staleness", "nproc", "overrides"),
                         # A scratch model never stops before the length cap, so every group of a step ends
                         # in the same decode step: 40 SFT steps teach it to stop at different lengths (up
                         # to ~30 tokens), and a batch of 2 groups then fills with groups left in flight. A
                         # cap of 48 that no response reaches: at 24 a quarter were cut at the cap, most
                         # groups ended at its decode step, and step 1 carried none.
                         [(2, 1, ("rollout.partial_rollout=true", "data.train_batch_size=2", "data.max_prompt_length=64",
                                  "data.max_response_length=48", "model.scratch.max_position_embeddings=128",
                                  "data.embedded.num_sft=200",
                                  "model.sft_warm_start.enable=true", "model.sft_warm_start.num_steps=40",
                                  "model.sft_warm_start.batch_size=16", "model.sft_warm_start.lr=3.0e-3")),
                          (1, 2, ("parallel.tensor_model_parallel_size=2",))],
                         ids=["k2-partial", "k1-tp2"])
def test_async_run_holds_the_invariants_within_the_bound(tmp_path, cache_dir, max_staleness, nproc, overrides):
    out = tmp_path / "run"
    # The record of every trained sample, checked against a recomputation (tests/trained_samples.py):
    # rewards reach their own responses in the asynchronous loop, stale and carried ones included.
    config = write_config(tmp_path / "tiny.yaml", reward={"reward_fn": "e2e_reward_fns:char_code_score",
                                                          "num_workers": 1, "overlong_buffer": {"enable": True, "len": 4}})
    record = tmp_path / "trained.jsonl"
    proc = run_trainer(config, f"trainer.output_dir={out}", "trainer.total_training_steps=5", *ASYNC,
                       f"trainer.max_staleness={max_staleness}", "algorithm.rollout_correction.rollout_is=token",
                       *overrides, cache_dir=cache_dir, nproc=nproc, env={TRAINED_SAMPLES_ENV: str(record)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert all("val/acc" in rows[s] for s in (0, 2, 4, 5))
    for row in rows[1:]:
        assert 0 < row["train/kept_group_acc_min"] <= row["train/kept_group_acc_max"] < 1
        groups = 2 if "data.train_batch_size=2" in overrides else 4
        assert row["train/num_groups"] == groups and row["train/num_responses"] == 4 * groups
        assert row["async/staleness_max"] <= max_staleness
        assert sum(row[f"async/staleness_hist/{a}"] for a in range(max_staleness + 1)) == pytest.approx(1.0)
        for key in ("timing_s/actor_idle", "timing_s/engine_idle", "timing_s/sync", "timing_s/collect"):
            assert row[key] >= 0, key
    # The first batch is generated under the start weights; later ones ahead of the actor.
    assert rows[1]["async/staleness_max"] == 0
    assert max(r["async/staleness_max"] for r in rows[1:]) >= 1
    groups = 2 if "data.train_batch_size=2" in overrides else 4
    max_len = 48 if "data.max_response_length=48" in overrides else 8
    assert check_run_records(record, out / "checkpoints" / "step_5" / "hf", n=4, num_groups=groups,
                             max_response_length=max_len, overlong=(4, 1.0)) == 5 * groups * 4
    if "rollout.partial_rollout=true" in overrides:
        # Step 1 is collected under the start weights with no update in flight, and the engine
        # process stops where its token counts say (rollout/local/process.py): the groups its full
        # batch leaves in flight are carried on every run (measured: 4 and 5 groups on seeds 1 and
        # 3). Later steps' carries depend on when the updates land (two full `make test` runs on
        # 2026-11-28 carried none, with the cap at 24); what a carry keeps is checked on each.
        assert rows[1]["rollout/carried_groups"] > 0, rows[1]
        for row in rows[1:]:
            # A continued response spans at most max_staleness + 1 versions (the bound is on its oldest token).
            assert 1 <= row["rollout/max_versions_per_response"] <= max_staleness + 1, row


def test_kill_9_while_rollouts_run_ahead_loses_and_repeats_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml")
    command = train_command(config, f"trainer.output_dir={out}", "trainer.total_training_steps=6",
                            "trainer.save_interval=1", "trainer.max_staleness=2",
                            "algorithm.rollout_correction.allow_uncorrected_staleness=true", *ASYNC)
    env = {**trainer_env(tmp_path / "cache"), "FAULT_TEST_TAG": uuid.uuid4().hex}
    metrics = out / "metrics.jsonl"

    def logged_step_3() -> bool:
        return metrics.is_file() and '"step": 3,' in metrics.read_text()

    # The producer has drawn the prompts of step 4 (and maybe 5) by then; the engine process
    # must go with the main process.
    kill_main_when(command, env, tmp_path / "a.log", logged_step_3)
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    # No prompt lost or repeated: the sampler advanced by exactly the prompts the logged steps took.
    state = json.loads((out / "checkpoints" / "step_6" / "trainer_state.json").read_text())
    sampler = state["sampler"]
    drawn = sampler["epoch"] * sampler["num_records"] + sampler["position"]
    assert drawn == sum(int(r["train/num_prompts_taken"]) for r in rows[1:])
    assert run_processes(env["FAULT_TEST_TAG"]) == []

