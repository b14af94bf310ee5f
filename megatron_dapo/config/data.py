"""The `data` section: prompt files or the embedded task, lengths and batch sizes.

Batch sizes count prompts (groups), as in verl: a step trains on
`data.train_batch_size * rollout.n` responses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_dapo.config.fields import _check, _check_path


@dataclass(kw_only=True, slots=True)
class EmbeddedTaskConfig:
    """The built-in arithmetic task used when no data files are given."""

    num_train: int = 4000
    """Training problems generated."""
    num_val: int = 200
    """Held-out problems for evaluation."""
    num_sft: int = 4000
    """Worked solutions for the SFT warm start."""
    seed: int = 1234
    """Generator seed (train, SFT and val are disjoint from val)."""
    sft_balance_columns: int = 8
    """SFT corpus only: k >= 2 takes each +/- problem as the least-taught of k of its kind, so
    every one-digit fact of a column, carries and borrows included, is taught about equally
    often (data.arithmetic.ColumnBalancer); 0 draws worked solutions as the mix does, which
    teaches some carry facts once in 4,000 problems (docs/benchmarks.md, issue 27)."""
    train_balance_columns: int = 0
    """The RL prompts, as sft_balance_columns does the SFT corpus: k >= 2 draws the carry and
    borrow problems a warm start is weakest on about as often as the plain ones; 0 draws them as
    the mix does. The held-out split always keeps the mix."""
    add: float = 0.3
    """Weight of a+b problems."""
    sub: float = 0.3
    """Weight of a-b problems."""
    mul: float = 0.2
    """Weight of a*b problems."""
    two_step: float = 0.2
    """Weight of two-operation problems with parentheses."""
    big_mul: float = 0.0
    """Weight of 3-digit x 2-digit products, the tool task's (data.arithmetic.ArithmeticMix.big_mul)."""
    sft_tool_share: float = 0.0
    """Share of the big_mul worked solutions that call the calculator (<calc>a*b</calc><result>..)."""
    sft_copy_drills: float = 0.0
    """SFT corpus only: the share of calling worked solutions whose tool result is a random number
    of the product's length, copied into the answer line (data.arithmetic.copy_drills). The answer
    then follows from the result span alone, so the warm start learns to copy what the tool returned
    instead of half-copying it (a warm start that read the first digit and then took the operands'
    digits never got past 3% of products in 3,000 steps; docs/benchmarks.md, issue 63)."""
    sft_copy_drill_digits: Literal["product", "mixed"] = "product"
    """How the drills' results are drawn: "product", uniform among the numbers of the product's
    width; "mixed", widths 3-6 with doubled digits at every position, so that only a copy by position
    is right on all of them (data.arithmetic.drill_result)."""
    sft_balance_product_digits: bool = False
    """SFT corpus only: big_mul products with 4-digit and 5-digit results in equal shares (drawn as
    the mix does, 17% are 4-digit, and a warm start then miscopies every one of them;
    data.arithmetic.balance_product_digits)."""
    max_digits: int = 2
    """Digits of +/- operands (1..6)."""
    solution_style: Literal["columns", "direct"] = "columns"
    """SFT solutions of +/-: one line per digit column (learnable by a tiny model) or direct."""
    tokenizer_vocab_size: int = 320
    """Vocabulary of the sentencepiece tokenizer trained on the task (digits are single tokens)."""

    def __post_init__(self) -> None:
        _check(self.num_train > 0, "num_train", "must be > 0")
        _check(self.num_val > 0, "num_val", "must be > 0")
        _check(self.num_sft > 0, "num_sft", "must be > 0")
        _check(self.sft_balance_columns == 0 or self.sft_balance_columns >= 2, "sft_balance_columns",
               "must be 0 (off) or k >= 2 (candidates per problem)")
        _check(self.train_balance_columns == 0 or self.train_balance_columns >= 2, "train_balance_columns",
               "must be 0 (off) or k >= 2 (candidates per problem)")
        for name in ("add", "sub", "mul", "two_step", "big_mul"):
            _check(getattr(self, name) >= 0, name, "must be >= 0")
        _check(self.add + self.sub + self.mul + self.two_step + self.big_mul > 0, "add", "the weights must not all be 0")
        _check(0 <= self.sft_tool_share <= 1, "sft_tool_share", "must be in [0, 1]")
        _check(0 <= self.sft_copy_drills <= 1, "sft_copy_drills", "must be in [0, 1]")
        _check(self.sft_copy_drills == 0 or self.sft_tool_share > 0, "sft_copy_drills",
               "drills the calling solutions, and there are none: set data.embedded.sft_tool_share > 0, "
               "or sft_copy_drills=0")
        _check(self.sft_copy_drill_digits == "product" or self.sft_copy_drills > 0, "sft_copy_drill_digits",
               "shapes the copy drills, and there are none: set data.embedded.sft_copy_drills > 0, "
               "or leave sft_copy_drill_digits at product")
        _check(1 <= self.max_digits <= 6, "max_digits", "must be in 1..6")
        _check(self.tokenizer_vocab_size >= 276, "tokenizer_vocab_size",
               "must be >= 276 (4 special ids + 256 byte-fallback pieces + 16 characters)")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompts and batch sizes (sizes count prompts, i.e. groups)."""

    train_files: list[str] = field(default_factory=list)
    """Parquet/jsonl files (DAPO-Math-17K schema or {prompt, answer}); empty = the embedded task."""
    val_files: list[str] = field(default_factory=list)
    """Held-out files; empty = the embedded task's held-out split (or none with train_files)."""
    max_prompt_length: int = 2048
    """Longer prompts are dropped (and counted)."""
    max_response_length: int = 20480
    """Generation budget per response (L_max)."""
    train_batch_size: int = 512
    """Prompt groups per RL step after dynamic sampling."""
    gen_batch_size: int = 1536
    """Prompts per generation round (over-sampling for dynamic sampling)."""
    shuffle: bool = True
    """Shuffle prompts each epoch (deterministic from `seed`)."""
    seed: int = 1
    """Data order seed."""
    embedded: EmbeddedTaskConfig = field(default_factory=EmbeddedTaskConfig)
    """The built-in task."""

    def __post_init__(self) -> None:
        for key, files in (("train_files", self.train_files), ("val_files", self.val_files)):
            _check(all(f.strip() for f in files), key, "holds an empty file name; list .parquet/.jsonl paths "
                   "(or [] for the embedded task)")
            for f in files:
                _check_path(f, key)
        _check(self.max_prompt_length > 0, "max_prompt_length", "must be > 0")
        _check(self.max_response_length > 0, "max_response_length", "must be > 0")
        _check(self.train_batch_size > 0, "train_batch_size", "must be > 0")
        _check(self.gen_batch_size >= self.train_batch_size, "gen_batch_size",
               f"must be >= train_batch_size={self.train_batch_size} (each round generates that many prompts)")
