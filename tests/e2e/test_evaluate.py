"""`megatron-dapo eval` on a training checkpoint: the trainer's last val/acc, resume, one-line errors."""

import json
import subprocess
import sys

import pytest
from trainer_utils import REPO, read_rows, run_trainer, trainer_env, write_config

pytestmark = pytest.mark.e2e

# 40 held-out prompts x 4 responses = 160 rows: three engine chunks (64, 64, 32), so the
# batching of the evaluation has to match the trainer's for the numbers to be equal.
VAL = {"rollout": {"engine": "local", "n": 4, "val_kwargs": {"n": 4, "temperature": 1.0, "top_p": 0.7}},
       "data": {"max_prompt_length": 80, "max_response_length": 8, "train_batch_size": 4, "gen_batch_size": 8,
                "embedded": {"num_train": 200, "num_val": 40, "num_sft": 50}}}


def run_eval(*args, cache_dir):
    return subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "eval", *map(str, args), "--no-progress"],
                          env=trainer_env(cache_dir), cwd=REPO, capture_output=True, text=True, timeout=600)


# Trained at TP=2 (two ranks), evaluated in one process: what a one-process run would check, and the
# layout change on top (a one-process variant cost CI 89 s and held nothing more, 2026-11-28).
@pytest.mark.parametrize(("nproc", "overrides"), [(2, ("parallel.tensor_model_parallel_size=2",))],
                         ids=["saved_at_tp2"])
def test_eval_of_the_last_checkpoint_equals_the_trainers_last_validation(tmp_path, nproc, overrides):
    cache_dir, run_dir = tmp_path / "cache", tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml", **VAL)
    proc = run_trainer(config, f"trainer.output_dir={run_dir}", *overrides, cache_dir=cache_dir, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(run_dir)
    last = rows[-1]
    for row in rows[1:]:  # every generated token counts: dropped groups' and aborted responses' too
        kept_tokens = row["train/num_responses"] * row["response_length/mean"]
        taken = row["train/num_prompts_taken"]  # streaming: every prompt an engine took
        assert kept_tokens - 1e-6 <= row["train/num_generated_tokens"] <= taken * 4 * 8
        if taken == row["train/num_groups"]:
            assert row["train/num_generated_tokens"] == pytest.approx(kept_tokens)
    (val_file,) = cache_dir.glob("arithmetic-*/val.jsonl")
    out = tmp_path / "eval" / "responses.jsonl"

    proc = run_eval(run_dir / "checkpoints" / "latest", "--data", val_file, "--out", out, cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "avg@4" in proc.stdout and "pass@4" in proc.stdout
    metrics = json.loads(out.with_suffix(".summary.json").read_text())["metrics"]["all"]
    assert metrics["num_prompts"] == 40
    assert metrics["avg@4"] == last["val/acc"]
    assert metrics["pass@4"] == pytest.approx(last["val/pass@4"], abs=1e-12)
    assert metrics["response_length/mean"] == pytest.approx(last["val/response_length/mean"], abs=1e-12)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 160 and {r["finish_reason"] for r in rows} <= {"stop", "length"}

    # Resume: keep 20 complete prompts and half a line, as a kill would leave; the rerun
    # generates only the other 20 and lands on the same numbers.
    lines = out.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if json.loads(ln)["index"] < 20]
    out.write_text("".join(kept) + lines[-1][:30])
    proc = run_eval(run_dir / "checkpoints" / "latest", "--data", val_file, "--out", out, cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "(20 prompts generated now)" in proc.stdout
    assert json.loads(out.with_suffix(".summary.json").read_text())["metrics"]["all"] == metrics
    assert sorted(out.read_text().splitlines()) == sorted(ln.rstrip("\n") for ln in lines)

    # The same file with other settings is refused in one line.
    proc = run_eval(run_dir / "checkpoints" / "latest", "--data", val_file, "--out", out, "--n", "2",
                    cache_dir=cache_dir)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "other settings" in proc.stderr


def test_eval_of_something_else_exits_2_with_one_line(tmp_path):
    (tmp_path / "notackpt").mkdir()
    proc = run_eval(tmp_path / "notackpt", "--data", tmp_path / "x.jsonl", cache_dir=tmp_path / "cache")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {tmp_path / 'notackpt'} is neither an HF directory (config.json + "
                                   "*.safetensors) nor a torch_dist checkpoint (step_<N>/, checkpoints/ or "
                                   "checkpoints/latest)")
