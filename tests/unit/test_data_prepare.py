"""tools/prepare_data.py: every source layout -> the trainer's schema, dedup, templates, errors.

The fixtures are a few rows written in each publisher's exact column layout (documented in
megatron_dapo/data/prepare.py with where each layout comes from).
"""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data.datasets import load_prompt_dataset
from megatron_dapo.data.errors import DataError
from megatron_dapo.data.prepare import (
    DAPO_INSTRUCTION_HEAD,
    DAPO_INSTRUCTION_TAIL,
    gsm8k_answer,
    last_boxed,
    main,
    read_problems,
)
from megatron_dapo.data.tokenizer import SentencePieceSettings, load_or_train_sentencepiece

REPO = Path(__file__).resolve().parents[2]
PAPER_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of "
                  "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
                  "{problem}\n\nRemember to put your answer on its own line after \"Answer:\".")


def dapo_row(problem, answer, uid):
    # BytedTsinghua-SIA/DAPO-Math-17k (and AIME-2024): the instruction is already in the prompt.
    return {"data_source": "math_dapo",
            "prompt": [{"content": DAPO_INSTRUCTION_HEAD + problem + DAPO_INSTRUCTION_TAIL, "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-math"},
            "extra_info": {"index": uid}}


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prepare(tmp_path, source, path, *extra):
    out = tmp_path / f"{source}.parquet"
    assert main(["--source", source, "--input", str(path), "--out", str(out), *extra]) == 0
    return pq.read_table(out).to_pylist()


def test_dapo_math_original_layout_dedups_and_applies_the_template_once(tmp_path):
    rows = [dapo_row("What is $1+1$?", "2", "a"), dapo_row("Find x if 2x = 6.", "3", "b"),
            dapo_row("What is  $1+1$?", "2", "c")]  # a repeat (the file repeats every problem)
    out = prepare(tmp_path, "dapo-math-17k", write_parquet(tmp_path / "dapo-math-17k.parquet", rows))
    assert [r["reward_model"]["ground_truth"] for r in out] == ["2", "3"]
    assert out[0]["prompt"] == [{"role": "user", "content": PAPER_TEMPLATE.format(problem="What is $1+1$?")}]
    assert out[0]["data_source"] == "math_dapo" and out[1]["extra_info"] == {"index": 1, "source_row": 1}


def test_dapo_math_processed_layout(tmp_path):
    # open-r1/DAPO-Math-17k-Processed: prompt is the first message's content, solution the answer.
    src = dapo_row("Compute 7*6.", "42", "u")
    rows = [{"prompt": src["prompt"][0]["content"], "solution": "42", "data_source": "math_dapo",
             "source_prompt": src["prompt"], "ability": "MATH", "reward_model": src["reward_model"],
             "extra_info": src["extra_info"]}]
    out = prepare(tmp_path, "dapo-math-17k", write_parquet(tmp_path / "processed.parquet", rows), "--template", "none")
    assert out[0]["prompt"][0]["content"] == "Compute 7*6." and out[0]["reward_model"]["ground_truth"] == "42"


def test_aime_both_layouts(tmp_path):
    dapo = [dapo_row("AIME problem one.", "204", "x")] * 3  # repeated for avg@32 in the original
    out = prepare(tmp_path, "aime2024", write_parquet(tmp_path / "aime-2024.parquet", dapo))
    assert len(out) == 1 and out[0]["reward_model"]["ground_truth"] == "204"
    # HuggingFaceH4/aime_2024 (id, problem, solution, answer, url, year) and Maxwell-Jia's capitals.
    h4 = [{"id": 60, "problem": "Every morning Aya walks 9 km.", "solution": "...", "answer": "204",
           "url": "https://artofproblemsolving.com/x", "year": "2024"}]
    out = prepare(tmp_path, "aime2024", write_parquet(tmp_path / "h4.parquet", h4))
    assert out[0]["prompt"][0]["content"] == PAPER_TEMPLATE.format(problem="Every morning Aya walks 9 km.")
    mj = [{"ID": "2024-I-1", "Problem": "Aya walks.", "Solution": "...", "Answer": 204}]
    out = prepare(tmp_path, "aime2024", write_parquet(tmp_path / "mj.parquet", mj))
    assert out[0]["reward_model"]["ground_truth"] == "204" and out[0]["data_source"] == "aime2024"


def test_gsm8k_answer_is_after_the_last_hash_line(tmp_path):
    assert gsm8k_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 1,200") == "1200"
    assert gsm8k_answer("x\n#### -3.5") == "-3.5"
    rows = [{"question": "Natalia sold clips to 48 friends...", "answer": "48/2 = <<48/2=24>>24\n48+24 = 72\n#### 72"}]
    out = prepare(tmp_path, "gsm8k", write_parquet(tmp_path / "main-test.parquet", rows))
    assert out[0]["reward_model"]["ground_truth"] == "72"


def test_math_answer_is_the_last_boxed(tmp_path):
    assert last_boxed(r"so $\boxed{3}$ or rather $\boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    assert last_boxed(r"The answer is $\boxed 5$.") == "5"
    assert last_boxed(r"\fbox{x+1}") == "x+1"
    rows = [{"problem": "How many vertical asymptotes does $y=\\frac{2}{x^2+x-6}$ have?", "level": "Level 3",
             "type": "Algebra", "solution": "The denominator factors ... so there are $\\boxed{2}$ asymptotes."}]
    out = prepare(tmp_path, "math", write_jsonl(tmp_path / "math.jsonl", rows))
    assert out[0]["reward_model"]["ground_truth"] == "2"


@pytest.mark.parametrize(("source", "row", "message"), [
    ("gsm8k", {"question": "q", "answer": "no marker"}, "row 1 column 'answer': has no '#### <number>' line"),
    ("math", {"problem": "p", "solution": "no box"}, "row 1 column 'solution': has no \\boxed{...} answer"),
    ("aime2024", {"problem": "p"}, "row 1 column 'answer': is missing"),
    ("dapo-math-17k", {"prompt": "p", "solution": ""}, "row 1 column 'solution': is '', expected non-empty text"),
])
def test_unreadable_rows_name_row_and_column(tmp_path, source, row, message):
    good = {"gsm8k": {"question": "q", "answer": "#### 1"}, "math": {"problem": "p", "solution": "\\boxed{1}"},
            "aime2024": {"problem": "p", "answer": "1"}, "dapo-math-17k": {"prompt": "p", "solution": "1"}}[source]
    path = write_jsonl(tmp_path / "in.jsonl", [good, row])
    with pytest.raises(DataError, match=None) as err:
        read_problems(path, source)
    assert f"{path} {message}" in str(err.value)


def test_output_loads_in_the_trainer_and_the_length_report_counts_tokens(tmp_path, capsys):
    rows = [dapo_row("What is 12+30?", "42", "a"), dapo_row("What is 2+2?", "4", "b")]
    src = write_parquet(tmp_path / "d.parquet", rows)
    corpus = [PAPER_TEMPLATE.format(problem=p) for p in ("What is 12+30?", "What is 2+2?")]
    tokenizer = load_or_train_sentencepiece(corpus * 20, tmp_path / "spm", SentencePieceSettings())
    out = tmp_path / "train.jsonl"
    model = next((tmp_path / "spm").glob("*/spm.model"))
    assert main(["--source", "dapo-math-17k", "--input", str(src), "--out", str(out), "--tokenizer", str(model),
                 "--max-prompt-length", "10"]) == 0
    lengths = sorted(len(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": c}]))) for c in corpus)
    report = capsys.readouterr().out
    assert f"prompt length in tokens: min {lengths[0]}," in report and f"max {lengths[1]};" in report
    assert "2 of 2 prompts exceed max_prompt_length=10" in report
    loaded = load_prompt_dataset(out, tokenizer, max_prompt_length=4096)
    assert [r.ground_truth for r in loaded.records] == ["42", "4"]


def test_tool_help_lists_the_sources_and_errors_exit_2(tmp_path):
    tool = [sys.executable, str(REPO / "tools" / "prepare_data.py")]
    env_help = subprocess.run([*tool, "--help"], capture_output=True, text=True, cwd=REPO, check=True)
    assert "{dapo-math-17k,aime2024,gsm8k,math}" in env_help.stdout
    for name in ("BytedTsinghua-SIA/DAPO-Math-17k", "open-r1/DAPO-Math-17k-Processed", "HuggingFaceH4/aime_2024",
                 "openai/gsm8k", "hendrycks/competition_math"):
        assert name in env_help.stdout
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q"}])
    proc = subprocess.run([*tool, "--source", "gsm8k", "--input", str(bad), "--out", str(tmp_path / "o.jsonl")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {bad} row 0 column 'answer': is missing (--source gsm8k; layouts in tools/prepare_data.py --help)"]
