"""Tokenizers behind one small interface: our sentencepiece model or a local HF tokenizer.

The trainer only ever needs to turn a prompt (chat messages) into token ids, decode
generated ids back to text for the reward, and know the eos/pad ids and vocab size.
`Tokenizer` is that interface. Two implementations:

- `SentencePieceTokenizer`: trained in about a second on the embedded arithmetic
  corpus (`load_or_train_sentencepiece`). Digits are split into single tokens, which
  is what lets a tiny model learn carries digit by digit; byte fallback plus a
  character coverage of 1.0 make every string round-trip exactly. The model file is
  cached under a directory named by a hash of the settings and the corpus, so every
  rank and every rerun loads the same file instead of retraining.
- `HFTokenizer`: wraps `AutoTokenizer` loaded from a LOCAL directory (the actor's
  HF checkpoint); nothing is fetched from the hub at run time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import sentencepiece as spm

from megatron_dapo.data.errors import DataError

# Fixed special ids of our sentencepiece models; pad 0 keeps padded batches zero-filled.
SPM_PAD_ID = 0
SPM_UNK_ID = 1
SPM_BOS_ID = 2
SPM_EOS_ID = 3

# Bumped when the training recipe below changes, so old cache entries are not reused.
_SPM_CACHE_VERSION = 1
SPM_MODEL_FILENAME = "spm.model"
# Files of which an HF model directory needs at least one to have a tokenizer.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def concat_messages(messages: Sequence[dict[str, str]]) -> str:
    """Renders chat messages without a template: their contents joined by newlines.

    Args:
        messages: chat messages, each with "role" and "content".

    Returns:
        The prompt text a tokenizer without a chat template is given.
    """
    return "\n".join(message["content"] for message in messages)


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline, rollouts and rewards need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        ...

    @property
    def eos_id(self) -> int:
        """Id that ends a response."""
        ...

    @property
    def pad_id(self) -> int:
        """Id used to pad batches (never attended to)."""
        ...

    @property
    def has_chat_template(self) -> bool:
        """Whether `render_chat` applies a chat template (else it concatenates contents)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens (eos, pad) left out."""
        ...

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        """Prompt text for `messages`, ending where the assistant's answer begins."""
        ...


def decodable(ids: Sequence[int], vocab_size: int) -> list[int]:
    """`ids` without those the tokenizer has no piece for.

    A model's vocabulary is often larger than its tokenizer's (Qwen2.5: 152,064 embedding rows for
    151,665 ids, padding for the kernels; a model trained with another tokenizer), and the policy
    can sample a padding id. The response keeps it (the actor trains on the sampled ids); its text,
    which the reward reads, has nothing for it, as for a special token.
    """
    return [i for i in ids if 0 <= i < vocab_size]


@dataclass(kw_only=True, slots=True, frozen=True)
class SentencePieceSettings:
    """How our sentencepiece tokenizer is trained; every field is part of the cache key."""

    vocab_size: int = 512
    """Upper bound on the vocabulary; a small corpus may yield fewer pieces."""
    model_type: str = "bpe"
    """sentencepiece model type: "bpe" or "unigram"."""
    split_digits: bool = True
    """One token per digit, so the model computes digit by digit."""
    byte_fallback: bool = True
    """Characters never seen in training are encoded as bytes instead of <unk>."""
    user_defined_symbols: tuple[str, ...] = ()
    """Strings that are always one piece (a tool format's markers: tools/formats.py)."""

    def __post_init__(self) -> None:
        if self.model_type not in ("bpe", "unigram"):
            raise ValueError(
                f"SentencePieceSettings.model_type={self.model_type!r} is not supported; "
                "use 'bpe' or 'unigram'"
            )
        # 4 special ids + 256 byte pieces must fit, with room for the corpus characters.
        min_vocab = 4 + (256 if self.byte_fallback else 0) + 16
        if self.vocab_size < min_vocab:
            raise ValueError(
                f"SentencePieceSettings.vocab_size={self.vocab_size} is too small "
                f"(byte_fallback={self.byte_fallback}); use at least {min_vocab}"
            )


class SentencePieceTokenizer:
    """Our sentencepiece model behind the `Tokenizer` interface (no chat template)."""

    __slots__ = ("_sp", "model_path")

    def __init__(self, model_path: str | Path) -> None:
        """Loads a sentencepiece model file.

        Args:
            model_path: path of a `.model` file written by `load_or_train_sentencepiece`.
        """
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise DataError(
                f"sentencepiece model {self.model_path} does not exist; build it with "
                "megatron_dapo.data.tokenizer.load_or_train_sentencepiece or fix the path"
            )
        self._sp = spm.SentencePieceProcessor(model_file=str(self.model_path))

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def has_chat_template(self) -> bool:
        return False

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        # sentencepiece renders control ids (pad, bos, eos) as empty strings, and raises on an id past
        # its vocabulary ("piece id is out of range"), which a model with more embedding rows than
        # the tokenizer has ids can sample: those decode to nothing (see decodable).
        return self._sp.decode(decodable(ids, self.vocab_size))

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        return concat_messages(messages)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary piece of one id (for debugging and tests)."""
        return self._sp.id_to_piece(token_id)


def _cache_key(texts: Sequence[str], settings: SentencePieceSettings) -> str:
    digest = hashlib.sha256()
    header = {"version": _SPM_CACHE_VERSION, **dataclasses.asdict(settings)}
    if not settings.user_defined_symbols:  # the key of every tokenizer trained before the field existed
        del header["user_defined_symbols"]
    digest.update(json.dumps(header, sort_keys=True).encode())
    for text in texts:
        encoded = text.encode("utf-8")
        # Length prefixes keep ["ab", "c"] and ["a", "bc"] apart.
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()[:16]


def _train_model_bytes(texts: Sequence[str], settings: SentencePieceSettings) -> bytes:
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=buffer,
        vocab_size=settings.vocab_size,
        model_type=settings.model_type,
        split_digits=settings.split_digits,
        byte_fallback=settings.byte_fallback,
        **({"user_defined_symbols": list(settings.user_defined_symbols)} if settings.user_defined_symbols else {}),
        character_coverage=1.0,
        pad_id=SPM_PAD_ID,
        unk_id=SPM_UNK_ID,
        bos_id=SPM_BOS_ID,
        eos_id=SPM_EOS_ID,
        # Exact round trips: no unicode normalization, no inserted leading space,
        # runs of spaces and newlines kept as they are.
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        # A small corpus cannot fill a large vocabulary; take what it supports.
        hard_vocab_limit=False,
        max_sentence_length=1 << 16,
        num_threads=1,
        minloglevel=2,
    )
    return buffer.getvalue()


def load_or_train_sentencepiece(
    texts: Iterable[str], cache_root: str | Path, settings: SentencePieceSettings
) -> SentencePieceTokenizer:
    """Returns the sentencepiece tokenizer for `texts`, training it only on a cache miss.

    The model lives at `<cache_root>/spm-<hash>/spm.model`, the hash covering the
    settings and every text, so a changed corpus or setting trains a new model and an
    unchanged one loads in milliseconds. The file is written atomically, so ranks or
    runs racing on the same cache see either nothing or a whole model.

    Args:
        texts: the training corpus (prompts and responses); empty strings are skipped.
        cache_root: directory holding cached models; created if missing.
        settings: training settings.

    Returns:
        The loaded tokenizer; its `model_path` is the cached file.
    """
    corpus = [text for text in texts if text]
    if not corpus:
        raise DataError("cannot train a sentencepiece tokenizer on an empty corpus; pass the task's texts")
    model_dir = Path(cache_root) / f"spm-{_cache_key(corpus, settings)}"
    model_path = model_dir / SPM_MODEL_FILENAME
    if not model_path.is_file():
        model_bytes = _train_model_bytes(corpus, settings)
        model_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=model_dir, prefix=".spm-", suffix=".tmp")
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(model_bytes)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, model_path)
    return SentencePieceTokenizer(model_path)


class HFTokenizer:
    """A transformers tokenizer behind the `Tokenizer` interface."""

    __slots__ = ("_eos_id", "_pad_id", "_tok")

    def __init__(self, tokenizer: Any, source: str = "<in-memory tokenizer>") -> None:
        """Wraps an already constructed transformers tokenizer.

        Args:
            tokenizer: a `PreTrainedTokenizerBase` (fast or slow).
            source: where it came from, named in errors.
        """
        self._tok = tokenizer
        if tokenizer.eos_token_id is None:
            raise DataError(
                f"tokenizer {source} has no eos token; set eos_token in its tokenizer_config.json"
            )
        self._eos_id = int(tokenizer.eos_token_id)
        # Base models often ship without a pad token; eos is never attended to when padding.
        pad = tokenizer.pad_token_id
        self._pad_id = self._eos_id if pad is None else int(pad)

    @property
    def vocab_size(self) -> int:
        # len() counts added special tokens, which `.vocab_size` of transformers omits.
        return len(self._tok)

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        # Special tokens come from the chat template text, never added twice here.
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(decodable(ids, self.vocab_size), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        if not self.has_chat_template:
            return concat_messages(messages)
        return self._tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Loads a tokenizer from local disk: a sentencepiece `.model` file or an HF directory.

    Args:
        path: a `.model` file written by `load_or_train_sentencepiece`, or a directory
            with an HF tokenizer (tokenizer.json / tokenizer_config.json), e.g. the
            actor's HF checkpoint.

    Returns:
        The tokenizer behind the `Tokenizer` interface.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".model":
        return SentencePieceTokenizer(path)
    if not path.is_dir():
        raise DataError(
            f"tokenizer path {path} is neither a sentencepiece .model file nor a local "
            "directory with an HF tokenizer; point it at one (nothing is downloaded at run time)"
        )
    found = sorted(p.name for p in path.iterdir() if p.name in HF_TOKENIZER_FILES)
    if not found and (path / SPM_MODEL_FILENAME).is_file():
        # An embedded-task model exported to HF carries its sentencepiece model (run.py).
        return SentencePieceTokenizer(path / SPM_MODEL_FILENAME)
    if not found:
        # transformers would build a tokenizer of one token from config.json alone: every prompt empty.
        raise DataError(
            f"{path} has no tokenizer files (none of {', '.join(HF_TOKENIZER_FILES)}); copy the model's "
            "tokenizer files into it or set model.tokenizer"
        )
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except RecursionError:  # json.load of a tokenizer file nested thousands deep (transformers' own read)
        raise DataError(f"{path}: a tokenizer file ({', '.join(found)}) is JSON nested too deeply to read; "
                        "re-download the model's tokenizer files") from None
    return HFTokenizer(loaded, source=str(path))
