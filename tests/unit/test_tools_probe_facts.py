"""tools/probe_facts.py: which tokens it reads a written result from, and a whole run on a tiny task."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_dapo.config.model import ScratchModelConfig
from megatron_dapo.data.arithmetic import ArithmeticMix, column_lines, prepare_arithmetic_task
from megatron_dapo.data.tokenizer import SentencePieceSettings, load_tokenizer
from megatron_dapo.embedded import scratch_checkpoint

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("probe_facts", REPO / "tools" / "probe_facts.py")
probe_facts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe_facts)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    mix = ArithmeticMix(add=0.5, sub=0.4, mul=0.1, two_step=0.0, max_digits=2)
    return prepare_arithmetic_task(tmp_path_factory.mktemp("task"), mix, num_train=60, num_val=20, num_sft=60, seed=3,
                                   tokenizer_settings=SentencePieceSettings(vocab_size=320))


@pytest.mark.parametrize(("a", "op", "b"), [(47, "+", 38), (52, "-", 17), (9, "+", 5), (8, "+", 25), (30, "-", 30)])
def test_each_written_result_is_read_from_exactly_its_own_tokens(task, a, op, b):
    tokenizer = load_tokenizer(task.tokenizer_path)
    lines = column_lines(a, op, b)
    answer = str(a + b if op == "+" else a - b)
    ids, spans = probe_facts.result_tokens(tokenizer, lines, answer)
    assert [name for name, _ in spans] == [*lines, "answer"]
    for (name, positions), expected in zip(spans, [line.split("=")[1] for line in lines] + [answer], strict=True):
        assert positions == list(range(positions[0], positions[-1] + 1)), name
        assert tokenizer.decode([ids[k] for k in positions]) == expected, name


def test_probe_reports_every_fact_of_the_split(task, tmp_path):
    hf = scratch_checkpoint(ScratchModelConfig(hidden_size=32, num_layers=1, num_attention_heads=2,
                                               num_key_value_heads=1, intermediate_size=64,
                                               max_position_embeddings=128), 320, 0, tmp_path)
    out = tmp_path / "report.json"
    assert probe_facts.main([str(hf), "--task", str(task.train_path.parent), "--splits", "val", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = [json.loads(line) for line in task.val_path.read_text().splitlines()]
    facts = {line for r in rows if r["extra_info"]["kind"] in ("add", "sub")
             for line in column_lines(*_operands(r["extra_info"]["expression"]))}
    assert report["facts"] == len(facts)
    assert sum(v["facts"] for v in report["fact_kinds"].values()) == len(facts)
    # A random model writes no result reliably: every whole solution is unlikely.
    assert all(0 < v["mean_p"] < 0.05 for v in report["problem_kinds"].values())
    assert probe_facts.main([str(tmp_path), "--task", str(task.train_path.parent)]) == 2


def _operands(expression: str) -> tuple[int, str, int]:
    op = "+" if "+" in expression else "-"
    a, b = expression.split(op)
    return int(a), op, int(b)
