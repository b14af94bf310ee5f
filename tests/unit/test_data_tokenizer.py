"""The sentencepiece tokenizer: exact round trips, digit splitting, special ids, the cache."""

import shutil
from pathlib import Path

import pytest
import sentencepiece as spm

from megatron_dapo.data.arithmetic import ArithmeticMix, generate_problems
from megatron_dapo.data.errors import DataError
from megatron_dapo.data.tokenizer import (
    SPM_MODEL_FILENAME,
    SentencePieceSettings,
    SentencePieceTokenizer,
    Tokenizer,
    load_or_train_sentencepiece,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    mix = ArithmeticMix(add=1, sub=1, mul=1, two_step=1, max_digits=3, allow_negative=True)
    problems = generate_problems(2000, mix, seed=3)
    return [text for p in problems for text in (p.prompt(), p.solution())]


def test_round_trip_on_whole_corpus(tmp_path: Path, corpus: list[str]) -> None:
    tokenizer = load_or_train_sentencepiece(corpus, tmp_path, SentencePieceSettings())
    assert isinstance(tokenizer, Tokenizer)
    assert [tokenizer.decode(tokenizer.encode(text)) for text in corpus] == corpus
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 2, 3)
    assert 256 + 4 < tokenizer.vocab_size <= 512
    # Specials vanish on decode, so a response ending with eos decodes to its text.
    assert tokenizer.decode([*tokenizer.encode("Answer: 7"), tokenizer.eos_id]) == "Answer: 7"


def test_digits_are_single_tokens_and_unseen_text_round_trips(tmp_path: Path, corpus: list[str]) -> None:
    tokenizer = load_or_train_sentencepiece(corpus, tmp_path, SentencePieceSettings())
    ids = tokenizer.encode("9071=x")
    assert [tokenizer.id_to_piece(i) for i in ids[:4]] == ["9", "0", "7", "1"]
    unseen = "Ünïcode ✓\ttabs  and  double spaces\n\n"
    assert tokenizer.decode(tokenizer.encode(unseen)) == unseen


def test_cache_hit_skips_training(tmp_path: Path, corpus: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_or_train_sentencepiece(corpus, tmp_path, SentencePieceSettings())

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained again despite a cached model")

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", no_training)
    second = load_or_train_sentencepiece(corpus, tmp_path, SentencePieceSettings())
    assert second.model_path == first.model_path
    assert second.encode(corpus[1]) == first.encode(corpus[1])
    # Another corpus or setting is another cache entry (and would train).
    with pytest.raises(AssertionError, match="trained again"):
        load_or_train_sentencepiece(corpus[:-1], tmp_path, SentencePieceSettings())
    with pytest.raises(AssertionError, match="trained again"):
        load_or_train_sentencepiece(corpus, tmp_path, SentencePieceSettings(vocab_size=400))
    assert [p.name for p in tmp_path.iterdir()] == [first.model_path.parent.name]


def test_bad_settings_and_paths() -> None:
    with pytest.raises(ValueError) as err:
        SentencePieceSettings(vocab_size=200)
    assert str(err.value) == (
        "SentencePieceSettings.vocab_size=200 is too small (byte_fallback=True); use at least 276"
    )
    with pytest.raises(DataError, match=r"sentencepiece model /nonexistent/spm\.model does not exist"):
        SentencePieceTokenizer("/nonexistent/spm.model")
    with pytest.raises(DataError, match="empty corpus"):
        load_or_train_sentencepiece(["", ""], "/nonexistent", SentencePieceSettings())


def test_an_hf_dir_without_tokenizer_files_is_refused(tmp_path: Path) -> None:
    # Before: transformers built a one-token tokenizer from config.json and every prompt was empty.
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(DataError, match=r"has no tokenizer files \(none of tokenizer.json, .*\); copy the model's "
                                        r"tokenizer files into it or set model.tokenizer"):
        load_tokenizer(tmp_path)


def test_an_exported_embedded_model_dir_loads_its_sentencepiece_model(tmp_path: Path, corpus: list[str]) -> None:
    trained = load_or_train_sentencepiece(corpus, tmp_path / "cache", SentencePieceSettings())
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text('{"model_type": "qwen2"}')
    shutil.copyfile(trained.model_path, export / SPM_MODEL_FILENAME)
    again = load_tokenizer(export)
    assert again.vocab_size == trained.vocab_size
    assert again.encode("12 + 30 = 42") == trained.encode("12 + 30 = 42") != []


def test_ids_past_the_tokenizer_decode_to_nothing(tmp_path: Path, corpus: list[str]) -> None:
    """Issue 42: a model with more embedding rows than its tokenizer has ids sampled one, and train and
    eval died in sentencepiece ("piece id is out of range"). Such ids have no text, like specials."""
    tokenizer = load_or_train_sentencepiece(corpus, tmp_path, SentencePieceSettings())
    ids = tokenizer.encode("Answer: 7")
    assert tokenizer.decode([*ids, tokenizer.vocab_size, tokenizer.vocab_size + 400]) == "Answer: 7"
    assert tokenizer.decode([tokenizer.vocab_size, *ids]) == "Answer: 7"
    with pytest.raises(IndexError):  # what sentencepiece itself does, the case this guards
        tokenizer._sp.decode([*ids, tokenizer.vocab_size])
