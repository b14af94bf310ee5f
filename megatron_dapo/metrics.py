"""Metrics of every RL step to the console, a JSONL file and (optionally) wandb, TensorBoard and MLflow (step 8).

Metric names follow verl's, which users' dashboards already expect:
critic/score/mean (verifier score), critic/rewards/mean (score + overlong shaping),
response_length/mean and /clip_ratio, train/num_gen_batches (dynamic-sampling
generation rounds), actor/* (loss, pg_clipfrac, entropy, grad_norm, lr), val/* and
timing_s/*.

`<output_dir>/metrics.jsonl` is the record of truth: one JSON object per step, flushed
and fsync'd before `log` returns, so a run killed at any moment keeps every finished
step. Every run first calls `truncate_after(checkpoint_step)` (-1 when it starts from
step 0), which drops the lines of steps the checkpoint does not contain, so no step
appears twice after any crash (output_dir.py has the rule).

The console gets one plain line per step (no carriage returns: CI logs stay
readable) with a progress bar and an ETA. wandb is imported only when enabled and
runs offline unless configured otherwise; the run id is kept in the output directory
so a resumed run continues the same wandb run.

TensorBoard (logging.tensorboard) gets the same scalars through torch's SummaryWriter under
<output_dir>/tensorboard; a resumed run purges the events after its checkpoint step, as
truncate_after does the JSONL lines. MLflow (logging.mlflow) gets them in one run whose id
is kept in the output directory, by default in a file store under <output_dir>/mlruns
(logging.mlflow_tracking_uri otherwise). MLflow refuses some characters in metric names:
mlflow_metric_name maps them ("val/pass@4" is "val/pass_4" there); a resumed run's redone
steps appear twice in MLflow's history (it cannot delete metric values).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import re
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from megatron_dapo.errors import UserError

METRICS_FILENAME = "metrics.jsonl"
WANDB_ID_FILENAME = "wandb_run_id.txt"
MLFLOW_ID_FILENAME = "mlflow_run_id.txt"
TENSORBOARD_DIRNAME = "tensorboard"
MLFLOW_DIRNAME = "mlruns"
METRICS_TMP_PREFIX = ".metrics-"
"""Prefix of the rewrite in progress of truncate_after; a leftover is deleted at the next start."""

# (metric key pattern, console label, format) of the one-line summary. A pattern is
# matched with fnmatch (validation keys carry the data source in their name); the
# first matching key in sorted order is shown, and labels without a match are skipped.
CONSOLE_KEYS: tuple[tuple[str, str, str], ...] = (
    ("critic/score/mean", "score", "{:+.3f}"),
    ("val*/acc*", "val_acc", "{:.3f}"),
    ("response_length/mean", "resp_len", "{:.1f}"),
    ("actor/pg_clipfrac", "clipfrac", "{:.4f}"),
    ("train/num_gen_batches", "gen_rounds", "{:.2g}"),  # streaming: prompts taken / gen_batch_size
    # The DAPO invariants, visible per step: the batch size and the kept groups' accuracy range.
    ("train/num_responses", "responses", "{:.0f}"),
    ("train/kept_group_acc_min", "kept_acc_min", "{:.2f}"),
    ("train/kept_group_acc_max", "kept_acc_max", "{:.2f}"),
    ("timing_s/step", "step_s", "{:.2f}"),
    ("perf/throughput*", "tok/s", "{:.0f}"),
)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Reads a metrics.jsonl file, skipping a torn last line left by a killed writer.

    Args:
        path: the metrics.jsonl file.

    Returns:
        One dict per step, in file order.
    """
    rows = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def format_duration(seconds: float) -> str:
    """Formats seconds as e.g. "42s", "7m05s" or "3h02m".

    Args:
        seconds: a non-negative duration.

    Returns:
        The compact text.
    """
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_bar(step: int, total_steps: int, width: int = 20) -> str:
    """A plain-text bar, e.g. "[#####---------------]  25%".

    Args:
        step: steps done.
        total_steps: steps in the run.
        width: characters inside the brackets.

    Returns:
        The bar with the percentage.
    """
    fraction = min(1.0, step / total_steps)
    filled = int(fraction * width)
    return f"[{'#' * filled}{'-' * (width - filled)}] {fraction * 100:3.0f}%"


class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl, the console and optionally wandb."""

    __slots__ = ("_file", "_first_step", "_mlflow", "_start_time", "_stream", "_tensorboard", "_wandb_run", "path",
                 "total_steps")

    def __init__(
        self,
        output_dir: str | Path,
        project: str,
        experiment: str,
        use_wandb: bool,
        total_steps: int,
        wandb_mode: str = "offline",
        config: dict[str, Any] | None = None,
        console: bool = True,
        jsonl: bool = True,
        stream: TextIO | None = None,
        tensorboard: bool = False,
        mlflow: bool = False,
        mlflow_tracking_uri: str | None = None,
    ) -> None:
        """Opens (appends to) `<output_dir>/metrics.jsonl` and starts wandb if asked.

        Args:
            output_dir: the run directory; created if missing.
            project: wandb project.
            experiment: wandb run name.
            use_wandb: also log to wandb (needs the wandb package).
            total_steps: steps in the run, for the progress bar and ETA.
            wandb_mode: "offline" (default; sync later with `wandb sync`), "online" or "disabled".
            config: the experiment config, stored with the wandb run.
            console: print one line per step.
            jsonl: append to metrics.jsonl (a resumed run relies on it for its history).
            stream: where the console lines go; sys.stdout by default.
            tensorboard: also write TensorBoard scalars under <output_dir>/tensorboard.
            mlflow: also log to MLflow (experiment `project`, run `experiment`).
            mlflow_tracking_uri: MLflow's tracking URI; None = a file store under <output_dir>/mlruns.
        """
        if total_steps <= 0:
            raise ValueError(f"total_steps={total_steps} must be positive")
        if wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb_mode={wandb_mode!r} is not one of 'offline', 'online', 'disabled'")
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / METRICS_FILENAME
        self.total_steps = total_steps
        self._stream = (stream if stream is not None else sys.stdout) if console else None
        self._file = self.path.open("a", encoding="utf-8") if jsonl else None
        self._start_time: float | None = None
        self._first_step: int | None = None
        self._wandb_run = (
            _start_wandb(output_dir, project, experiment, wandb_mode, config) if use_wandb else None
        )
        self._tensorboard = _TensorBoard(output_dir / TENSORBOARD_DIRNAME) if tensorboard else None
        self._mlflow = _MLflow(output_dir, project, experiment, mlflow_tracking_uri) if mlflow else None

    def truncate_after(self, step: int) -> int:
        """Drops the lines of steps after `step` (the step the run continues from).

        Args:
            step: the last step to keep: a resumed run's checkpoint step, or -1 for a run
                that starts from step 0 (which logs step 0 again). Lines with a larger
                step are removed, as is a torn line from a killed writer.

        Returns:
            The number of lines removed (0 when JSONL logging is off).

        Raises:
            UserError: the file cannot be rewritten (disk full, read-only); the file is unchanged.
        """
        if self._tensorboard is not None:
            self._tensorboard.purge_step = step + 1
        if self._file is None:
            return 0
        self._file.close()
        with self.path.open(encoding="utf-8") as f:
            lines = f.readlines()
        kept = []
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        if len(kept) != len(lines):
            self._rewrite(kept)
        self._file = self.path.open("a", encoding="utf-8")
        return len(lines) - len(kept)

    def _rewrite(self, lines: list[str]) -> None:
        """Atomically replace the file with `lines`, keeping its permission bits."""
        fd, tmp_name = tempfile.mkstemp(dir=self.path.parent, prefix=METRICS_TMP_PREFIX, suffix=".tmp")
        try:
            # mkstemp makes the file 0600; the replacement keeps what the user's umask gave the original.
            os.fchmod(fd, self.path.stat().st_mode & 0o7777)
            with os.fdopen(fd, "w", encoding="utf-8") as tmp:
                tmp.writelines(lines)
                tmp.flush()
                os.fsync(tmp.fileno())
            os.replace(tmp_name, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            reason = os.strerror(e.errno) if e.errno else str(e)
            raise UserError(f"cannot rewrite {self.path} to drop the steps after the resume point ({reason}); "
                            "free space or fix the permissions, then rerun the same command") from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Records one finished step: JSONL line (durable on return), console line, wandb.

        Args:
            step: the RL step, 1-based.
            metrics: metric name -> value (ints, floats, bools, 0-d tensors).
        """
        row: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            number = float(value)
            # JSON has no NaN/Inf; null keeps the line parseable by any reader.
            row[key] = number if math.isfinite(number) else None
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        if self._stream is not None:
            self._stream.write(self._console_line(step, row) + "\n")
            self._stream.flush()
        scalars = {k: v for k, v in row.items() if k != "step" and v is not None}
        if self._wandb_run is not None:
            self._wandb_run.log(scalars, step=step)
        if self._tensorboard is not None:
            self._tensorboard.log(step, scalars)
        if self._mlflow is not None:
            self._mlflow.log(step, scalars)

    def _console_line(self, step: int, row: dict[str, Any]) -> str:
        now = time.monotonic()
        if self._start_time is None:
            # The ETA follows this process's own pace (a resumed run's checkpointed steps
            # took unknown time). The first step counts when it reports its duration.
            step_seconds = row.get("timing_s/step")
            self._start_time = now - (step_seconds or 0.0)
            self._first_step = step - 1 if step_seconds else step
        steps_here = step - self._first_step
        remaining = max(0, self.total_steps - step)
        if steps_here > 0:
            eta = format_duration((now - self._start_time) / steps_here * remaining)
        else:
            eta = "?" if remaining else "0s"
        parts = [f"step {step}/{self.total_steps} {progress_bar(step, self.total_steps)} eta {eta}"]
        keys = sorted(row)
        for pattern, label, fmt in CONSOLE_KEYS:
            match = next((k for k in keys if fnmatch.fnmatchcase(k, pattern) and row[k] is not None), None)
            if match is not None:
                parts.append(f"{label} {fmt.format(row[match])}")
        return " | ".join(parts)

    def close(self) -> None:
        """Closes the JSONL file and finishes the wandb run."""
        if self._file is not None:
            self._file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._mlflow is not None:
            self._mlflow.close()
            self._mlflow = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start_wandb(
    output_dir: Path, project: str, experiment: str, mode: str, config: dict[str, Any] | None
) -> Any:
    try:
        import wandb
    except ImportError as e:
        raise UserError(f"logging.wandb=true but wandb cannot be imported ({e}); "
                        "pip install wandb or set logging.wandb=false") from None
    # Reusing the id makes a resumed run continue its wandb curves instead of starting over.
    id_file = output_dir / WANDB_ID_FILENAME
    if id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
    return wandb.init(
        project=project,
        name=experiment,
        id=run_id,
        resume="allow",
        dir=str(output_dir),
        mode=mode,
        config=config or {},
    )


def check_trackers(tensorboard: bool, mlflow: bool) -> None:
    """The packages logging.tensorboard / logging.mlflow need (preflight: `config validate`, train).

    Raises:
        UserError: one is enabled and its package does not import.
    """
    wanted = [("logging.tensorboard", "torch.utils.tensorboard", "tensorboard")] if tensorboard else []
    wanted += [("logging.mlflow", "mlflow", "mlflow-skinny")] if mlflow else []
    for key, module, package in wanted:
        try:
            __import__(module)
        except ImportError as e:
            raise UserError(f"{key}=true but {module} cannot be imported ({e}); pip install {package} "
                            f"(pinned in constraints/cpu.txt) or set {key}=false") from None


def mlflow_metric_name(key: str) -> str:
    """The name MLflow stores a metric under: characters it refuses (outside letters, digits,
    _ - . / : and space) become "_"."""
    return re.sub(r"[^/\w.\- :]", "_", key)


class _TensorBoard:
    """Scalars through torch.utils.tensorboard.SummaryWriter, opened at the first step logged so
    that a resumed run's purge_step (set by truncate_after) hides the redone steps' old events."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (fails here, not at step 1)

        self.log_dir = log_dir
        self.purge_step: int | None = None
        self._writer: Any = None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self.purge_step)
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class _MLflow:
    """One MLflow run through MlflowClient (no global active run); its id is kept in the run directory."""

    def __init__(self, output_dir: Path, experiment: str, run_name: str, tracking_uri: str | None) -> None:
        if tracking_uri is None:
            # MLflow 3 keeps its file store only on request; a database store needs full mlflow.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            tracking_uri = (output_dir / MLFLOW_DIRNAME).resolve().as_uri()
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        id_file = output_dir / MLFLOW_ID_FILENAME
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
        else:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            id_file.write_text(self.run_id + "\n")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_metric_name(k), v, now, step) for k, v in scalars.items()]
        for start in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000], synchronous=True)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Timer:
    """Accumulates wall-clock seconds per phase as timing_s/<name>.

    A phase timed several times in one step (generation rounds of dynamic sampling)
    adds up; `pop` hands the totals to the metrics and starts the next step at zero.
    """

    __slots__ = ("_totals",)

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Times the body of a `with timer("gen"):` block.

        Args:
            name: phase name; recorded as timing_s/<name>.
        """
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing_s/{name}"
            self._totals[key] = self._totals.get(key, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        """Returns the totals since the last pop and resets them.

        Returns:
            timing_s/<name> -> seconds.
        """
        totals, self._totals = self._totals, {}
        return totals
