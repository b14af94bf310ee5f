"""examples/custom_reward end to end: a verl-style compute_score reward trains 2 steps and its scores are
logged, to metrics.jsonl and, with logging.tensorboard/mlflow, to TensorBoard and MLflow, which their
own readers give back equal to the JSONL; logging.rollout_dump_freq dumps every response (issue 60)."""

from __future__ import annotations

import json

import pytest
from trainer_utils import REPO, read_rows, run_trainer

pytestmark = pytest.mark.e2e

EXAMPLE = REPO / "examples" / "custom_reward" / "custom_reward.yaml"
# The example at the e2e tests' tiny sizes (trainer_utils.TINY_CONFIG): a random-init model, no warm start.
TINY = ("model.scratch={hidden_size: 64, num_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
        "intermediate_size: 128, max_position_embeddings: 88}", "model.sft_warm_start.enable=false",
        "rollout.n=4", "rollout.val_kwargs.n=2", "data.max_prompt_length=80", "data.max_response_length=8",
        "data.train_batch_size=4", "data.gen_batch_size=8", "data.embedded={num_train: 200, num_val: 8, num_sft: 50}",
        # A random-init model answers nothing right: every group all-wrong, which dynamic sampling would drop.
        "algorithm.filter_groups.enable=false", "reward.num_workers=1", "reward.overlong_buffer.len=4",
        "trainer.total_training_steps=2", "trainer.ppo_mini_batch_size=2", "trainer.test_freq=2",
        "trainer.max_tokens_per_microbatch=256", "trainer.logprob_chunk_size=64")


def test_a_verl_reward_trains_and_every_tracker_reads_back_the_jsonl(tmp_path, monkeypatch):
    out = tmp_path / "run"
    command = (*TINY, f"trainer.output_dir={out}", "logging.tensorboard=true", "logging.mlflow=true",
               "logging.rollout_dump_freq=1")
    proc = run_trainer(EXAMPLE, *command, cache_dir=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The same command again: the run is finished, which it says in one line and a code of its own.
    metrics = (out / "metrics.jsonl").read_text()
    again = run_trainer(EXAMPLE, *command, cache_dir=tmp_path / "cache")
    assert again.returncode == 5, again.stderr[-4000:]
    errors = [line for line in again.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {out} already holds the checkpoint of step 2 of trainer.total_training_steps=2: "
                      "nothing to train; to continue this run raise trainer.total_training_steps (e.g. "
                      "trainer.total_training_steps=4), or start afresh with a new trainer.output_dir"]
    assert "warm start" not in again.stderr and "engine" not in again.stderr.lower()
    assert (out / "metrics.jsonl").read_text() == metrics
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        # The example's compute_score: +-1 per response, and its extra number "formatted".
        assert -1.0 <= row["critic/score/mean"] <= 1.0 and row["reward/num_errors"] == 0
        assert 0.0 <= row["reward_extra/formatted/mean"] <= 1.0
        assert row["actor/grad_norm"] is not None
    assert "val/score/mean" in rows[0] and "val/score/mean" in rows[2]
    expected = {(key, r["step"]): r[key] for r in rows for key in r if key != "step" and r[key] is not None}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    tensorboard = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert tensorboard.keys() == expected.keys()
    for key, value in expected.items():  # TensorBoard stores float32
        assert tensorboard[key] == pytest.approx(value, rel=1e-6, abs=1e-30), key

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    from megatron_dapo.metrics import mlflow_metric_name

    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    run = client.get_run((out / "mlflow_run_id.txt").read_text().strip())
    assert run.info.status == "FINISHED" and run.info.run_name == "custom_reward"
    names = {mlflow_metric_name(key) for key, _ in expected}
    assert set(run.data.metrics) == names
    logged = {(m.key, m.step): m.value for name in names for m in client.get_metric_history(run.info.run_id, name)}
    assert logged == {(mlflow_metric_name(key), step): value for (key, step), value in expected.items()}

    dumped = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [d["step"] for d in dumped] == [1] * 16 + [2] * 16  # train_batch_size x rollout.n per step
    for d in dumped:
        assert d["data_source"] == "my_arithmetic" and d["prompt"].startswith("Compute ")
        assert d["score"] in (-1.0, 1.0) and d["reward"] <= d["score"] and isinstance(d["response"], str)
        assert {"advantage", "ground_truth", "response_length", "finish_reason", "acc"} <= d.keys()
