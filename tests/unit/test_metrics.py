"""MetricsLogger: JSONL contents, resume truncation, console line, no wandb needed; Timer; plot tool."""

import importlib.util
import io
import json
import re
import sys
from pathlib import Path

import pytest

from megatron_dapo.metrics import (
    METRICS_FILENAME,
    MetricsLogger,
    Timer,
    format_duration,
    progress_bar,
    read_metrics,
)

REPO = Path(__file__).resolve().parents[2]


def make_logger(run_dir: Path, stream: io.StringIO | None = None, total_steps: int = 10) -> MetricsLogger:
    return MetricsLogger(
        run_dir,
        project="p",
        experiment="e",
        use_wandb=False,
        total_steps=total_steps,
        stream=stream or io.StringIO(),
    )


def test_jsonl_has_one_exact_line_per_step(tmp_path: Path) -> None:
    with make_logger(tmp_path) as logger:
        logger.log(1, {"critic/score/mean": 0.25, "train/num_gen_batches": 2, "actor/entropy": float("nan")})
        logger.log(2, {"critic/score/mean": -0.5})
        # Durable before close: another reader sees both steps now.
        assert len(read_metrics(tmp_path / METRICS_FILENAME)) == 2
    lines = (tmp_path / METRICS_FILENAME).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "critic/score/mean": 0.25, "train/num_gen_batches": 2.0, "actor/entropy": None},
        {"step": 2, "critic/score/mean": -0.5},
    ]


def test_truncate_after_drops_later_steps_and_torn_line(tmp_path: Path) -> None:
    with make_logger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"critic/score/mean": step / 10})
    with (tmp_path / METRICS_FILENAME).open("a") as f:
        f.write('{"step": 6, "critic/sc')  # killed mid-write
    with make_logger(tmp_path) as resumed:
        assert resumed.truncate_after(3) == 3
        resumed.log(4, {"critic/score/mean": 0.9})
    rows = read_metrics(tmp_path / METRICS_FILENAME)
    assert [(r["step"], r["critic/score/mean"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.9)]


def test_console_line_is_plain_with_chosen_keys(tmp_path: Path) -> None:
    stream = io.StringIO()
    with make_logger(tmp_path, stream=stream, total_steps=4) as logger:
        logger.log(
            1,
            {
                "critic/score/mean": 0.25,
                "val/arithmetic/acc/mean": 0.5,
                "response_length/mean": 12.34,
                "actor/pg_clipfrac": 0.00123,
                "train/num_gen_batches": 2,
                "timing_s/step": 30.0,
                "perf/throughput": 812.4,
                "actor/lr": 1e-6,
            },
        )
        logger.log(4, {"critic/score/mean": -1.0})
    first, last = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert first.startswith("step 1/4 [#####---------------]  25% eta 1m")
    assert first.split(" | ")[1:] == [
        "score +0.250",
        "val_acc 0.500",
        "resp_len 12.3",
        "clipfrac 0.0012",
        "gen_rounds 2",
        "step_s 30.00",
        "tok/s 812",
    ]
    assert last == "step 4/4 [####################] 100% eta 0s | score -1.000"


def test_console_and_jsonl_can_be_switched_off(tmp_path: Path) -> None:
    stream = io.StringIO()
    logger = MetricsLogger(
        tmp_path, "p", "e", use_wandb=False, total_steps=3, console=False, jsonl=False, stream=stream
    )
    logger.log(1, {"critic/score/mean": 0.0})
    assert logger.truncate_after(0) == 0
    logger.close()
    assert stream.getvalue() == ""
    assert not (tmp_path / METRICS_FILENAME).exists()


def test_no_wandb_needed_unless_enabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with make_logger(tmp_path) as logger:
        logger.log(1, {"critic/score/mean": 1.0})
    assert read_metrics(tmp_path / METRICS_FILENAME) == [{"step": 1, "critic/score/mean": 1.0}]
    with pytest.raises(ValueError) as err:
        MetricsLogger(tmp_path, "p", "e", use_wandb=True, total_steps=1)
    # The key a user sets is logging.wandb (it said metrics.use_wandb, which does not exist).
    assert str(err.value).startswith("logging.wandb=true but wandb cannot be imported (")
    assert str(err.value).endswith("); pip install wandb or set logging.wandb=false")


def test_formatting_helpers() -> None:
    assert [format_duration(s) for s in (0, 42.4, 425, 10920)] == ["0s", "42s", "7m05s", "3h02m"]
    assert progress_bar(0, 8, width=8) == "[--------]   0%"
    assert progress_bar(3, 8, width=8) == "[###-----]  38%"


def test_timer_accumulates_and_pops(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter([10.0, 12.5, 20.0, 21.0, 30.0, 30.25])
    monkeypatch.setattr("megatron_dapo.metrics.time.perf_counter", lambda: next(ticks))
    timer = Timer()
    with timer("gen"):
        pass
    with timer("gen"):
        pass
    with pytest.raises(RuntimeError), timer("update"):
        raise RuntimeError("a failing phase is still timed")
    assert timer.pop() == {"timing_s/gen": 3.5, "timing_s/update": 0.25}
    assert timer.pop() == {}


def load_plot_tool():
    spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "tools" / "plot_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_tool_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with make_logger(tmp_path, total_steps=20) as logger:
        for step in range(1, 21):
            logger.log(
                step,
                {
                    "critic/score/mean": -1 + step / 10,
                    "critic/rewards/mean": -1.1 + step / 10,
                    "actor/entropy": 2.0 - step / 20,
                    "response_length/mean": 30 + step,
                    "response_length/clip_ratio": 0.01,
                    "actor/pg_clipfrac": 0.002,
                    "train/num_gen_batches": 1 + step % 3,
                    **({"val/arithmetic/acc/mean": step / 25} if step % 5 == 0 else {}),
                },
            )
    tool = load_plot_tool()
    out = tmp_path / "curves.png"
    assert tool.main([str(tmp_path), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out} (7 panels, 20 steps)\n"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(data[16:20], "big") == 1200  # 12 inches at 100 dpi


def test_plot_tool_exits_2_on_missing_or_empty(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tool = load_plot_tool()
    assert tool.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'metrics.jsonl'} does not exist; pass the run's output directory\n"
    )
    (tmp_path / "metrics.jsonl").write_text("")
    assert tool.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'metrics.jsonl'} has no complete step yet; plot after the first step finished\n"
    )
    assert not (tmp_path / "metrics.png").exists()


def test_wandb_offline_run_is_resumed_under_same_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    run_ids = []
    for step in (1, 2):
        with MetricsLogger(
            tmp_path, "p", "e", use_wandb=True, total_steps=2, config={"lr": 1e-6}, stream=io.StringIO()
        ) as logger:
            logger.log(step, {"critic/score/mean": 0.5, "actor/entropy": float("inf")})
        run_ids.append((tmp_path / "wandb_run_id.txt").read_text().strip())
    assert run_ids[0] == run_ids[1] and len(run_ids[0]) == 8
    offline_runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    # Two inits within one second share a directory name, which wandb then suffixes with "-1".
    assert offline_runs and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_ids[0]}(-\d+)?", name)
                                for name in offline_runs), offline_runs
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILENAME)] == [1, 2]


def test_plot_tool_over_seeds_draws_the_mean_and_the_min_max_band(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    runs = []
    for seed, offset in ((1, 0.0), (2, 0.2), (3, 0.4)):
        run = tmp_path / f"seed{seed}"
        with make_logger(run, total_steps=4) as logger:
            for step in range(1, 5):
                logger.log(step, {"critic/score/mean": offset + step / 10,
                                  **({"val/acc": offset + step} if step % 2 == 0 or seed == 1 else {})})
        runs.append(run)
    tool = load_plot_tool()
    rows = [tool.read_rows(r / "metrics.jsonl") for r in runs]
    steps, mean, low, high = tool.band(rows, "critic/score/mean")
    assert steps == [1, 2, 3, 4]
    assert mean == pytest.approx([0.3, 0.4, 0.5, 0.6]) and low == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert high == pytest.approx([0.5, 0.6, 0.7, 0.8])
    # Steps only some runs logged: the mean and band of those runs.
    assert tool.band(rows, "val/acc")[1] == pytest.approx([1.0, 2.2, 3.0, 4.2])
    assert tool.main([str(r) for r in runs]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'metrics.png'} (2 panels, 3 runs, 4 steps)\n"
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tool.main([str(runs[0]), str(tmp_path / "missing")]) == 2
