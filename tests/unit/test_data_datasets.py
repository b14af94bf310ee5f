"""Prompt files: both schemas, jsonl and parquet, exact row errors, length filter, chat template, sampler."""

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data.datasets import (
    EXPECTED_SCHEMA,
    PromptSampler,
    load_prompt_dataset,
)
from megatron_dapo.data.errors import DataError
from megatron_dapo.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer


class CharTokenizer:
    """One token per character: prompt lengths in tokens are their lengths in characters."""

    vocab_size = 0x110000
    eos_id = 0
    pad_id = 0
    has_chat_template = False

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return "\n".join(m["content"] for m in messages)


def dapo_row(question: str, answer: str, **extra: object) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": question}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "abc"},
        **extra,
    }


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_char_tokenizer_satisfies_protocol() -> None:
    assert isinstance(CharTokenizer(), Tokenizer)


def test_dapo_jsonl_loads_every_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [dapo_row("1+1?", "2"), dapo_row("2+3?", "5")])
    ds = load_prompt_dataset(path, CharTokenizer(), max_prompt_length=100)
    assert len(ds) == 2 and ds.num_dropped_too_long == 0
    rec = ds[1]
    assert rec.prompt_ids == [ord(c) for c in "2+3?"]
    assert rec.messages == [{"role": "user", "content": "2+3?"}]
    assert rec.prompt_text == "2+3?"
    assert (rec.ground_truth, rec.data_source, rec.index) == ("5", "math_dapo", 1)
    assert rec.extra_info == {"index": "abc"}


def test_plain_jsonl_uses_default_data_source_and_stringifies_answer(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "7*6", "answer": 42}])
    rec = load_prompt_dataset(path, CharTokenizer(), max_prompt_length=100, default_data_source="arith")[0]
    assert (rec.prompt_text, rec.ground_truth, rec.data_source) == ("7*6", "42", "arith")
    assert rec.messages == [{"role": "user", "content": "7*6"}]


def test_parquet_matches_jsonl(tmp_path: Path) -> None:
    rows = [dapo_row(f"q{i}", str(i)) for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    write_jsonl(tmp_path / "d.jsonl", rows)
    from_parquet = load_prompt_dataset(tmp_path / "d.parquet", CharTokenizer(), max_prompt_length=100)
    from_jsonl = load_prompt_dataset(tmp_path / "d.jsonl", CharTokenizer(), max_prompt_length=100)
    assert [r.prompt_ids for r in from_parquet.records] == [r.prompt_ids for r in from_jsonl.records]
    assert [r.ground_truth for r in from_parquet.records] == ["0", "1", "2", "3", "4"]


def test_missing_ground_truth_names_file_and_line(tmp_path: Path) -> None:
    bad = dapo_row("q", "1")
    del bad["reward_model"]["ground_truth"]
    path = write_jsonl(tmp_path / "d.jsonl", [dapo_row("q", "1"), bad])
    with pytest.raises(DataError) as err:
        load_prompt_dataset(path, CharTokenizer(), max_prompt_length=100)
    assert str(err.value) == (
        f"{path} line 2: DAPO-Math-17K row (list 'prompt') has no 'reward_model.ground_truth' "
        f"field; {EXPECTED_SCHEMA}"
    )


def test_plain_row_without_answer_names_line_after_blank_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1", "answer": "2"}\n\n{"prompt": "2+2"}\n')
    with pytest.raises(DataError) as err:
        load_prompt_dataset(path, CharTokenizer(), max_prompt_length=100)
    assert (
        str(err.value)
        == f"{path} line 3: plain row (string 'prompt') has no 'answer' field; {EXPECTED_SCHEMA}"
    )


def test_bad_message_and_bad_json_and_missing_prompt(tmp_path: Path) -> None:
    cases = [
        (
            [dapo_row("q", "1", prompt=[{"role": "user"}])],
            "prompt[0] = {'role': 'user'} is not a message with string 'role' and 'content'",
        ),
        ([{"question": "q", "answer": "1"}], "row has no 'prompt' field"),
        ([{"prompt": 3, "answer": "1"}], "'prompt' is a int, not a string or a list of messages"),
        ([{"prompt": "q", "answer": ["1"]}], "'answer' = ['1'] is not a string or number"),
    ]
    for rows, problem in cases:
        path = write_jsonl(tmp_path / "c.jsonl", rows)
        with pytest.raises(DataError) as err:
            load_prompt_dataset(path, CharTokenizer(), max_prompt_length=100)
        assert str(err.value) == f"{path} line 1: {problem}; {EXPECTED_SCHEMA}"
    path = tmp_path / "j.jsonl"
    path.write_text('{"prompt": "q", "answer": "1"}\n{"prompt": \n')
    with pytest.raises(DataError) as err:
        load_prompt_dataset(path, CharTokenizer(), max_prompt_length=100)
    assert str(err.value) == f"{path} line 2: invalid JSON (Expecting value); {EXPECTED_SCHEMA}"


def test_parquet_error_names_zero_based_row(tmp_path: Path) -> None:
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    with pytest.raises(DataError) as err:
        load_prompt_dataset(tmp_path / "p.parquet", CharTokenizer(), max_prompt_length=100)
    assert str(err.value) == (
        f"{tmp_path / 'p.parquet'} row 1 (0-based): 'answer' = None is not a string or number; {EXPECTED_SCHEMA}"
    )


def test_unknown_extension_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"has extension '\.csv'; use a \.jsonl or \.parquet file"):
        load_prompt_dataset(tmp_path / "d.csv", CharTokenizer(), max_prompt_length=10)
    with pytest.raises(DataError, match="does not exist"):
        load_prompt_dataset(tmp_path / "nope.jsonl", CharTokenizer(), max_prompt_length=10)


def test_length_filter_drops_and_logs_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    prompts = ["x" * n for n in (3, 8, 5, 9, 4)]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "answer": "0"} for p in prompts])
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.data.datasets"):
        ds = load_prompt_dataset(path, CharTokenizer(), max_prompt_length=5)
    assert ds.num_dropped_too_long == 2
    assert [r.index for r in ds.records] == [0, 2, 4]
    assert caplog.messages == [
        f"dropped 2 of 5 prompts of {path} longer than max_prompt_length=5 tokens (longest: 9)"
    ]
    with pytest.raises(DataError) as err:
        load_prompt_dataset(path, CharTokenizer(), max_prompt_length=2)
    assert str(err.value) == (
        f"all 5 prompts of {path} are longer than max_prompt_length=2 tokens (longest: 9); "
        "raise max_prompt_length or shorten the prompts"
    )


def _save_chat_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "what", "is", "2+2", "?"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    tok.save_pretrained(directory)


def test_chat_template_from_local_hf_tokenizer(tmp_path: Path) -> None:
    _save_chat_tokenizer(tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.has_chat_template, tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size) == (
        True,
        1,
        0,
        9,
    )
    path = write_jsonl(tmp_path / "d.jsonl", [dapo_row("what is 2+2 ?", "4")])
    rec = load_prompt_dataset(path, tokenizer, max_prompt_length=16)[0]
    assert rec.prompt_text == "<|user|> what is 2+2 ? <|assistant|> "
    assert rec.prompt_ids == [3, 5, 6, 7, 8, 4]
    assert tokenizer.decode([5, 6, 1]) == "what is"


def test_load_tokenizer_rejects_missing_path(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        load_tokenizer(tmp_path / "missing")
    assert str(err.value) == (
        f"tokenizer path {tmp_path / 'missing'} is neither a sentencepiece .model file nor a local "
        "directory with an HF tokenizer; point it at one (nothing is downloaded at run time)"
    )


def _records(tmp_path: Path, n: int) -> list:
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(n)])
    return load_prompt_dataset(path, CharTokenizer(), max_prompt_length=10).records


def test_sampler_epochs_are_permutations_and_seeded(tmp_path: Path) -> None:
    records = _records(tmp_path, 7)
    sampler = PromptSampler(records, seed=3)
    # 3 batches of 5 cross two epoch boundaries (7 and 14 prompts).
    drawn = [r.index for _ in range(3) for r in sampler.next_batch(5)]
    assert sorted(drawn[:7]) == list(range(7)) and sorted(drawn[7:14]) == list(range(7))
    assert drawn[:7] != drawn[7:14]
    assert sampler.state_dict() == {"epoch": 2, "position": 1, "seed": 3, "num_records": 7, "shuffle": True}
    replay = PromptSampler(records, seed=3)
    again = [r.index for _ in range(3) for r in replay.next_batch(5)]
    assert again == drawn
    other = [r.index for r in PromptSampler(records, seed=4).next_batch(7)]
    assert other != drawn[:7]
    ordered = PromptSampler(records, seed=3, shuffle=False)
    assert [r.index for r in ordered.next_batch(9)] == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_sampler_resume_draws_what_uninterrupted_run_draws(tmp_path: Path) -> None:
    records = _records(tmp_path, 11)
    uninterrupted = PromptSampler(records, seed=9)
    full = [[r.index for r in uninterrupted.next_batch(4)] for _ in range(10)]

    first = PromptSampler(records, seed=9)
    for _ in range(6):
        first.next_batch(4)
    state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
    resumed = PromptSampler(records, seed=9)
    resumed.load_state_dict(state)
    rest = [[r.index for r in resumed.next_batch(4)] for _ in range(4)]
    assert rest == full[6:]
    assert resumed.epoch == 3


def test_sampler_rejects_state_of_other_dataset(tmp_path: Path) -> None:
    state = PromptSampler(_records(tmp_path, 11), seed=9).state_dict()
    sampler = PromptSampler(_records(tmp_path, 10), seed=9)
    with pytest.raises(DataError) as err:
        sampler.load_state_dict(state)
    assert str(err.value) == (
        "the checkpoint's prompt sampler has num_records=11 but this run has num_records=10; "
        "resume with the same data files, max_prompt_length and seed or start a new run"
    )
