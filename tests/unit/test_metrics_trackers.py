"""logging.tensorboard / logging.mlflow: MetricsLogger's scalars read back by TensorBoard's own reader and
MLflow's own client equal to metrics.jsonl, also across a resume; logging.rollout_dump_freq's file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from megatron_dapo.collect.dump import dump_rollouts, should_dump, truncate_dump
from megatron_dapo.collect.types import Group, Sample
from megatron_dapo.data.datasets import PromptRecord
from megatron_dapo.errors import UserError
from megatron_dapo.metrics import (
    METRICS_FILENAME,
    MetricsLogger,
    check_trackers,
    mlflow_metric_name,
    read_metrics,
)


def _logger(run_dir: Path, **kwargs: object) -> MetricsLogger:
    return MetricsLogger(run_dir, project="proj", experiment="exp", use_wandb=False, total_steps=4,
                         stream=io.StringIO(), tensorboard=True, mlflow=True, **kwargs)  # type: ignore[arg-type]


def _tensorboard(run_dir: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}


def _mlflow(run_dir: Path, uri: str | None = None) -> dict[tuple[str, int], list[float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri or (run_dir / "mlruns").as_uri())
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    found: dict[tuple[str, int], list[float]] = {}
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            found.setdefault((m.key, m.step), []).append(m.value)
    return found


def _jsonl(run_dir: Path) -> dict[tuple[str, int], float]:
    return {(k, r["step"]): v for r in read_metrics(run_dir / METRICS_FILENAME) for k, v in r.items()
            if k != "step" and v is not None}


STEPS = [{"critic/score/mean": 0.25, "val/pass@4": 0.5, "actor/entropy": float("nan"), "timing_s/step": 1.5},
         {"critic/score/mean": -0.125, "val/pass@4": 0.75, "actor/entropy": 0.3, "timing_s/step": 1.25},
         {"critic/score/mean": 0.5, "actor/entropy": 0.2}]


def test_tensorboard_and_mlflow_read_back_the_jsonl_across_a_resume(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with _logger(tmp_path) as logger:
        logger.truncate_after(-1)
        for step, metrics in enumerate(STEPS, 1):
            logger.log(step, metrics)
    jsonl = _jsonl(tmp_path)
    assert len(jsonl) == 9  # NaN is null in the JSONL and absent from both trackers
    assert _tensorboard(tmp_path) == pytest.approx(jsonl)
    assert _mlflow(tmp_path) == {(mlflow_metric_name(k), s): [v] for (k, s), v in jsonl.items()}
    # A resume from step 1's checkpoint redoes steps 2 and 3 with other values: TensorBoard shows
    # the new ones only, as the JSONL; MLflow keeps both (it cannot delete), in the same run.
    redo = [{"critic/score/mean": 0.0, "val/pass@4": 1.0, "timing_s/step": 2.0}, {"critic/score/mean": 1.0}]
    with _logger(tmp_path) as logger:
        logger.truncate_after(1)
        for step, metrics in enumerate(redo, 2):
            logger.log(step, metrics)
    jsonl = _jsonl(tmp_path)
    assert jsonl[("critic/score/mean", 3)] == 1.0 and ("actor/entropy", 3) not in jsonl
    assert _tensorboard(tmp_path) == pytest.approx(jsonl)
    assert _mlflow(tmp_path)[("critic/score/mean", 3)] == [0.5, 1.0]
    assert _mlflow(tmp_path)[("val/pass_4", 2)] == [0.75, 1.0]


def test_mlflow_logs_to_the_tracking_uri_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = (tmp_path / "elsewhere").as_uri()
    with _logger(tmp_path / "run", mlflow_tracking_uri=store) as logger:
        logger.log(1, {"critic/score/mean": 0.5})
    assert not (tmp_path / "run" / "mlruns").exists()
    assert _mlflow(tmp_path / "run", store) == {("critic/score/mean", 1): [0.5]}


def test_mlflow_names_keep_what_mlflow_accepts() -> None:
    assert mlflow_metric_name("val/pass@32") == "val/pass_32"
    assert mlflow_metric_name("val-core/my_src.v2/acc:mean x") == "val-core/my_src.v2/acc:mean x"


def test_a_tracker_without_its_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_mlflow(name: str, *args: object, **kwargs: object) -> object:
        if name == "mlflow":
            raise ImportError("No module named 'mlflow'")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    check_trackers(tensorboard=True, mlflow=False)
    with pytest.raises(UserError, match=r"^logging.mlflow=true but mlflow cannot be imported \(No module named "
                                        r"'mlflow'\); pip install mlflow-skinny"):
        check_trackers(tensorboard=False, mlflow=True)


def _group(step: int) -> Group:
    record = PromptRecord(prompt_ids=[1, 2], messages=[{"role": "user", "content": "Compute 1+1."}],
                          prompt_text="Compute 1+1.", ground_truth="2", data_source="my_arithmetic", index=step)
    samples = [Sample(prompt_ids=[1, 2], response_ids=[3] * (i + 1), rollout_log_probs=[0.0] * (i + 1),
                      finish_reason="stop", score=1.0 - 2 * i, acc=i == 0, overlong_penalty=-0.5 * i,
                      advantage=0.7 - i, reward_extra={"formatted": 1.0}) for i in range(2)]
    return Group(prompt=record, samples=samples)


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return "x" * len(ids)


def test_rollout_dump_every_n_steps_and_its_resume(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    assert [s for s in range(1, 7) if should_dump(s, 2)] == [2, 4, 6] and not should_dump(3, 0)
    for step in (2, 4):
        assert dump_rollouts(path, step, [_group(step)], _Tokenizer()) == 2  # type: ignore[arg-type]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[1] == {"step": 2, "data_source": "my_arithmetic", "prompt_index": 2, "prompt": "Compute 1+1.",
                       "response": "xx", "ground_truth": "2", "score": -1.0, "acc": False, "reward": -1.5,
                       "advantage": -0.30000000000000004, "response_length": 2, "finish_reason": "stop",
                       "reward_extra": {"formatted": 1.0}}
    with path.open("a") as f:
        f.write('{"step": 6, "torn')
    truncate_dump(path, 3)  # a resume from step 3's checkpoint
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [2, 2]
