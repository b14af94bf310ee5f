"""What makes the default run reproducible: the warm-start cache key and the pinned environment."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_dapo.config.loader import load_config
from megatron_dapo.embedded import NUMERIC_LIBRARIES, environment_key, warm_start

REPO = Path(__file__).resolve().parents[2]
SOURCES = {"sft_path": "/c/arithmetic-1/sft.jsonl", "tokenizer": "/c/arithmetic-1/tok/spm.model",
           "val": "/c/arithmetic-1/val.jsonl"}


def key_dir(cfg, dims=(1, 1, 1)):
    layout = SimpleNamespace(tp=dims[0], pp=dims[1], dp=dims[2])
    return warm_start.sft_cache_dir(cfg, Path("/c/scratch-abc"), SOURCES, layout, Path("/c")).name


def test_warm_start_cache_key_covers_every_input(monkeypatch):
    base = load_config(REPO / "examples" / "tiny_cpu.yaml")
    assert key_dir(base) == key_dir(load_config(REPO / "examples" / "tiny_cpu.yaml"))
    changed = {
        "layout": key_dir(base, dims=(2, 1, 1)),
        "micro-batching": key_dir(load_config(REPO / "examples" / "tiny_cpu.yaml",
                                              ["trainer.max_tokens_per_microbatch=512"])),
        "clip_grad": key_dir(load_config(REPO / "examples" / "tiny_cpu.yaml", ["optim.clip_grad=0.5"])),
        "band": key_dir(load_config(REPO / "examples" / "tiny_cpu.yaml", ["model.sft_warm_start.target_acc_max=0.5"])),
        "check sampling": key_dir(load_config(REPO / "examples" / "tiny_cpu.yaml", ["rollout.val_kwargs.top_p=0.9"])),
    }
    with monkeypatch.context() as m:
        m.setattr(warm_start, "environment_key", lambda: {**environment_key(), "cpu_capability": "OTHER"})
        changed["cpu kernels"] = key_dir(base)
        m.setattr(warm_start, "environment_key",
                  lambda: {**environment_key(), "libraries": {**environment_key()["libraries"], "torch": "9.9"}})
        changed["torch version"] = key_dir(base)
    unchanged = [name for name, key in changed.items() if key == key_dir(base)]
    assert unchanged == []


def test_environment_key_names_the_numeric_libraries():
    env = environment_key()
    assert set(env["libraries"]) == set(NUMERIC_LIBRARIES)
    assert env["libraries"]["torch"] is not None and env["cpu_capability"]


def test_constraints_pin_every_requirement_and_keep_transformers_in_vllm_cpus_range():
    pins = {}
    for line in (REPO / "constraints" / "cpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name.lower())] = version
    setup = (REPO / "setup.py").read_text()
    required = re.findall(r'"([A-Za-z][A-Za-z0-9_.-]*)(?:\[[^\]]*\])?[<>=!~]', setup.split("extras_require")[0])
    required += ["pytest", "pytest-xdist", "hypothesis", "ruff", "mkdocs", "mkdocs-material"]
    assert [r for r in required if re.sub(r"[-_.]+", "-", r.lower()) not in pins] == []
    assert pins["torch"] == "2.13.0" and pins["megatron-core"] == "0.16.1"
    major, minor, patch = (int(x) for x in pins["transformers"].split("."))
    assert (5, 16, 1) <= (major, minor, patch) < (5, 20, 0)


@pytest.mark.parametrize(("band", "message"), [
    ("model.sft_warm_start.target_acc_min=0.3", "set both target_acc_min and target_acc_max"),
])
def test_band_needs_both_ends(band, message):
    from megatron_dapo.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "examples" / "tiny_cpu.yaml", ["model.sft_warm_start.target_acc_max=null", band])


def test_band_by_kind_without_a_band_is_refused():
    # It was silently ignored: a fixed-length warm start with band_by_kind: true read no band at all.
    from megatron_dapo.config import ConfigError

    with pytest.raises(ConfigError, match=r"band_by_kind.*applies to a band"):
        load_config(REPO / "examples" / "tiny_tools_cpu.yaml", ["model.sft_warm_start.target_acc_min=null",
                                                                 "model.sft_warm_start.target_acc_max=null"])


def test_check_interval_below_the_default_fine_interval_loads_and_keeps_its_gap():
    # CI, 2026-11-26: a config with check_interval=5 was refused once the fine interval's default
    # (10) had to be <= check_interval; the fine interval only ever shortens the gap.
    cfg = load_config(REPO / "examples" / "tiny_cpu.yaml", ["model.sft_warm_start.check_interval=5"])
    s = cfg.model.sft_warm_start
    assert (s.check_interval, s.fine_check_interval) == (5, 10)
    assert warm_start.check_gap(True, s.check_interval, s.fine_check_interval) == 5
    assert warm_start.check_gap(False, 50, 10) == 50
    assert warm_start.check_gap(True, 50, 10) == 10
    assert warm_start.check_gap(True, 50, None) == 50


def test_fine_interval_must_be_positive():
    from megatron_dapo.config import ConfigError

    with pytest.raises(ConfigError, match="fine_check_interval=0: must be > 0"):
        load_config(REPO / "examples" / "tiny_cpu.yaml", ["model.sft_warm_start.fine_check_interval=0"])


def test_band_by_kind_enters_the_warm_start_key_only_when_on():
    # Off (the default), the key is the one every warm start cached before the field existed.
    base = load_config(REPO / "examples" / "tiny_cpu.yaml")
    layout = SimpleNamespace(tp=1, pp=1, dp=1)
    key = warm_start.sft_cache_key(base, Path("/c/scratch-abc"), SOURCES, layout)
    assert "band_by_kind" not in key["sft"]
    on = load_config(REPO / "examples" / "tiny_cpu.yaml", ["model.sft_warm_start.band_by_kind=true"])
    assert warm_start.sft_cache_key(on, Path("/c/scratch-abc"), SOURCES, layout)["sft"]["band_by_kind"] is True
    assert key_dir(on) != key_dir(base)


def test_balanced_product_digits_enter_the_task_key_only_when_on(tmp_path):
    from megatron_dapo.config import EmbeddedTaskConfig
    from megatron_dapo.embedded import task_for

    common = dict(num_train=50, num_val=20, num_sft=100, add=0.5, sub=0.0, mul=0.0, two_step=0.0, big_mul=0.5,
                  sft_tool_share=1.0)
    off = task_for(EmbeddedTaskConfig(**common), tmp_path)
    on = task_for(EmbeddedTaskConfig(**common, sft_balance_product_digits=True), tmp_path)
    assert off.sft_path.parent != on.sft_path.parent and off.sft_path.read_text() != on.sft_path.read_text()
    drilled = task_for(EmbeddedTaskConfig(**common, sft_copy_drills=0.5), tmp_path)
    assert drilled.sft_path.parent not in (off.sft_path.parent, on.sft_path.parent)
    assert drilled.sft_path.read_text() != off.sft_path.read_text()
    assert drilled.val_path.read_text() == off.val_path.read_text()
    mixed = task_for(EmbeddedTaskConfig(**common, sft_copy_drills=0.5, sft_copy_drill_digits="mixed"), tmp_path)
    padded = task_for(EmbeddedTaskConfig(**common), tmp_path, result_width=6)
    assert padded.sft_path.parent not in (off.sft_path.parent, mixed.sft_path.parent)
    assert padded.val_path.read_text() == off.val_path.read_text()
    assert mixed.sft_path.parent != drilled.sft_path.parent and mixed.sft_path.read_text() != drilled.sft_path.read_text()


def test_a_runs_task_pads_its_warm_start_as_its_tool_answers_and_only_with_tools_on(tmp_path):
    from megatron_dapo.config import load_config
    from megatron_dapo.embedded import task_for, task_of

    small = ["data.embedded.num_train=50", "data.embedded.num_val=20", "data.embedded.num_sft=100"]
    config = REPO / "examples" / "tiny_tools_cpu.yaml"
    assert load_config(config).tools.result_width == 6  # the example pads (docs/benchmarks.md, issue 63)
    plain = task_for(load_config(config, small).data.embedded, tmp_path)
    assert task_of(load_config(config, [*small, "tools.result_width=0"]), tmp_path) == plain
    padded = task_of(load_config(config, small), tmp_path)
    assert padded == task_for(load_config(config, small).data.embedded, tmp_path, result_width=6) != plain
    assert "_</result>" in padded.sft_path.read_text() and "_</result>" not in plain.sft_path.read_text()
    assert task_of(load_config(config, [*small, "tools.enable=false"]), tmp_path) == plain
