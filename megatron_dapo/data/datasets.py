"""Prompt datasets and the resumable prompt sampler (step 1 of the RL loop).

Two row schemas are read from `.jsonl` or `.parquet` files:

- DAPO-Math-17K (also verl's RL dataset format): `prompt` is a list of chat messages
  `{"role", "content"}`, the reference answer is `reward_model.ground_truth`, and
  `data_source` picks the verifier; `extra_info` is optional and kept as is.
- plain: `prompt` is a string and `answer` the reference answer (the embedded
  arithmetic task writes this one).

Prompts are rendered with the tokenizer's chat template where it has one and
tokenized once at load time; prompts longer than `max_prompt_length` tokens are
dropped (and counted), because the rollout engines reserve exactly that much room.

`PromptSampler` walks the dataset in an epoch-wise shuffled order fixed by a seed.
Its state is two integers (epoch, position), saved with every checkpoint, so a
resumed run draws exactly the prompts an uninterrupted run would have drawn.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_dapo.data.errors import DataError
from megatron_dapo.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

EXPECTED_SCHEMA = (
    'expected either DAPO-Math-17K rows {"prompt": [{"role": str, "content": str}, ...], '
    '"reward_model": {"ground_truth": str}, "data_source": str, "extra_info": {...} (optional)} '
    'or plain rows {"prompt": str, "answer": str, "data_source": str (optional)}'
)


@dataclass(kw_only=True, slots=True)
class PromptRecord:
    """One prompt, tokenized, with what the reward needs to score its responses."""

    prompt_ids: list[int]
    """Token ids of the rendered prompt, given to the rollout engine as is."""
    messages: list[dict[str, str]]
    """The prompt as chat messages (a plain string prompt becomes one user message)."""
    prompt_text: str
    """The rendered prompt (chat template applied, or contents concatenated)."""
    ground_truth: str
    """Reference answer the verifier compares against."""
    data_source: str
    """Which verifier scores this prompt (e.g. "math_dapo")."""
    index: int
    """0-based row of this prompt in its file, for tracing a sample back to its source."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """The row's `extra_info`, passed through untouched."""


@dataclass(kw_only=True, slots=True)
class PromptDataset:
    """The prompts of one file that fit in `max_prompt_length` tokens."""

    records: list[PromptRecord]
    """Kept prompts, in file order."""
    path: Path
    """The file they were read from."""
    num_dropped_too_long: int
    """Rows dropped because their prompt exceeded `max_prompt_length` tokens."""

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]


def _iter_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Yields (location, row) pairs; location names the file and row for error messages."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open("rb") as f:
            for line_number, raw in enumerate(f, start=1):
                where = f"{path} line {line_number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                    "save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: invalid JSON ({e.msg}); {EXPECTED_SCHEMA}") from None
                except RecursionError:
                    raise DataError(f"{where}: JSON nested too deeply to read; {EXPECTED_SCHEMA}") from None
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:  # truncated or not parquet at all
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"prompt file {path} cannot be read as parquet ({first[:200]}); "
                            "the file is truncated or corrupted: copy or export it again") from None
        for row_number, row in enumerate(rows):
            yield f"{path} row {row_number} (0-based)", row
    else:
        raise DataError(f"prompt file {path} has extension {path.suffix!r}; use a .jsonl or .parquet file")


def _parse_messages(value: Any, where: str) -> list[dict[str, str]]:
    if not value:
        raise DataError(f"{where}: 'prompt' is an empty list; {EXPECTED_SCHEMA}")
    messages = []
    for i, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DataError(
                f"{where}: prompt[{i}] = {message!r} is not a message with string 'role' and "
                f"'content'; {EXPECTED_SCHEMA}"
            )
        messages.append({"role": message["role"], "content": message["content"]})
    if not any(m["content"].strip() for m in messages):
        raise DataError(f"{where}: every message of 'prompt' has empty 'content'; give the question or drop the row")
    return messages


def _parse_ground_truth(value: Any, where: str, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DataError(f"{where}: {key} = {value!r} is not a string or number; {EXPECTED_SCHEMA}")
    # json.loads reads NaN/Infinity (and pandas writes a missing value as NaN): no response can match it.
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(f"{where}: {key} = {value!r} is not a finite number (a missing answer?); "
                        "give the reference answer or drop the row")
    if not str(value).strip():
        raise DataError(f"{where}: {key} is empty; give the reference answer or drop the row")
    return str(value)


def parse_row(row: Any, where: str, default_data_source: str) -> tuple[list[dict[str, str]], str, str, dict]:
    """Validates one row of either schema.

    Args:
        row: the decoded row.
        where: "<file> line N" / "<file> row N", named in errors.
        default_data_source: data source for rows without one.

    Returns:
        (messages, ground_truth, data_source, extra_info).
    """
    if not isinstance(row, dict) or "prompt" not in row:
        raise DataError(f"{where}: row has no 'prompt' field; {EXPECTED_SCHEMA}")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if "answer" not in row:
            raise DataError(f"{where}: plain row (string 'prompt') has no 'answer' field; {EXPECTED_SCHEMA}")
        if not prompt.strip():
            raise DataError(f"{where}: 'prompt' is an empty string; give the question or drop the row")
        messages = [{"role": "user", "content": prompt}]
        ground_truth = _parse_ground_truth(row["answer"], where, "'answer'")
    elif isinstance(prompt, list):
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise DataError(
                f"{where}: DAPO-Math-17K row (list 'prompt') has no 'reward_model.ground_truth' "
                f"field; {EXPECTED_SCHEMA}"
            )
        messages = _parse_messages(prompt, where)
        ground_truth = _parse_ground_truth(reward_model["ground_truth"], where, "'reward_model.ground_truth'")
    else:
        raise DataError(
            f"{where}: 'prompt' is a {type(prompt).__name__}, not a string or a list of messages; "
            f"{EXPECTED_SCHEMA}"
        )
    data_source = row.get("data_source") or default_data_source
    if not isinstance(data_source, str):
        raise DataError(f"{where}: 'data_source' = {data_source!r} is not a string; {EXPECTED_SCHEMA}")
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DataError(f"{where}: 'extra_info' = {extra_info!r} is not an object; {EXPECTED_SCHEMA}")
    return messages, ground_truth, data_source, extra_info


def load_prompt_dataset(
    path: str | Path,
    tokenizer: Tokenizer,
    max_prompt_length: int,
    default_data_source: str = "math_dapo",
    where_set: str = "data.train_files / data.val_files",
) -> PromptDataset:
    """Reads, validates, renders and tokenizes every prompt of a jsonl or parquet file.

    Args:
        path: a `.jsonl` or `.parquet` file in either schema (see the module docstring).
        tokenizer: renders the chat messages and encodes them.
        max_prompt_length: prompts with more tokens than this are dropped.
        default_data_source: data source of rows that have none; "math_dapo" is the
            verifier of DAPO-Math-17K.
        where_set: where the path was given, for errors (`eval` passes "--data").

    Returns:
        The kept prompts and the number dropped for length.
    """
    path = Path(path)
    if max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length={max_prompt_length} must be positive")
    if path.is_dir():
        raise DataError(f"prompt file {path} is a directory; {where_set}: list the .jsonl/.parquet files inside it")
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist; check {where_set}")
    records: list[PromptRecord] = []
    num_rows = 0
    num_dropped = 0
    longest = 0
    for index, (where, row) in enumerate(_iter_rows(path)):
        num_rows += 1
        messages, ground_truth, data_source, extra_info = parse_row(row, where, default_data_source)
        prompt_text = tokenizer.render_chat(messages)
        prompt_ids = tokenizer.encode(prompt_text)
        longest = max(longest, len(prompt_ids))
        if len(prompt_ids) > max_prompt_length:
            num_dropped += 1
            continue
        records.append(
            PromptRecord(
                prompt_ids=prompt_ids,
                messages=messages,
                prompt_text=prompt_text,
                ground_truth=ground_truth,
                data_source=data_source,
                index=index,
                extra_info=extra_info,
            )
        )
    if num_rows == 0:
        raise DataError(f"prompt file {path} has no rows; {EXPECTED_SCHEMA}")
    if not records:
        raise DataError(
            f"all {num_rows} prompts of {path} are longer than max_prompt_length={max_prompt_length} "
            f"tokens (longest: {longest}); raise max_prompt_length or shorten the prompts"
        )
    if num_dropped:
        logger.warning(
            "dropped %d of %d prompts of %s longer than max_prompt_length=%d tokens (longest: %d)",
            num_dropped,
            num_rows,
            path,
            max_prompt_length,
            longest,
        )
    return PromptDataset(records=records, path=path, num_dropped_too_long=num_dropped)


class PromptSampler:
    """Draws prompts in an epoch-wise shuffled order that a checkpoint can resume exactly.

    The order of epoch e is a permutation seeded by (seed, e) alone, so it does not
    depend on how many prompts were drawn before; the state is (epoch, position).
    """

    __slots__ = ("_epoch", "_order", "_position", "_records", "seed", "shuffle")

    def __init__(self, records: Sequence[PromptRecord], seed: int, shuffle: bool = True) -> None:
        """Starts at epoch 0, position 0.

        Args:
            records: the prompts to draw from (e.g. `PromptDataset.records`).
            seed: fixes every epoch's order.
            shuffle: False walks the file order every epoch.
        """
        if not records:
            raise DataError("PromptSampler needs at least one prompt; the dataset is empty")
        self._records = records
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._records)))
        if self.shuffle:
            # A string seed is hashed with sha512 by `random`: stable across processes
            # and Python runs, independent of PYTHONHASHSEED.
            random.Random(f"megatron-dapo-prompts:{self.seed}:{epoch}").shuffle(order)
        return order

    def position_of(self, record: PromptRecord) -> int:
        """Where `record` (an object this sampler drew) sits in its record list (for checkpoints)."""
        for position, candidate in enumerate(self._records):
            if candidate is record:
                return position
        raise ValueError(f"prompt {record.index} of {record.data_source!r} is not one of this sampler's records")

    def record_at(self, position: int) -> PromptRecord:
        """The record at a `position_of` position."""
        return self._records[position]

    @property
    def epoch(self) -> int:
        """Epochs completed so far (0 during the first pass)."""
        return self._epoch

    def next_batch(self, num_prompts: int) -> list[PromptRecord]:
        """Draws the next `num_prompts` prompts, continuing into the next epoch as needed.

        Args:
            num_prompts: how many prompts to draw (may exceed the dataset size).

        Returns:
            The prompts, in draw order.
        """
        if num_prompts <= 0:
            raise ValueError(f"num_prompts={num_prompts} must be positive")
        batch = []
        while len(batch) < num_prompts:
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
            take = min(num_prompts - len(batch), len(self._order) - self._position)
            batch.extend(self._records[i] for i in self._order[self._position : self._position + take])
            self._position += take
        return batch

    def state_dict(self) -> dict[str, int | bool]:
        """The sampler's position, for the checkpoint.

        Returns:
            {"epoch", "position", "seed", "num_records", "shuffle"}.
        """
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "num_records": len(self._records),
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Continues from a saved position; seed, dataset size and shuffle must match.

        Args:
            state: what `state_dict` returned in the interrupted run.
        """
        for key, current in (
            ("seed", self.seed),
            ("num_records", len(self._records)),
            ("shuffle", self.shuffle),
        ):
            if state[key] != current:
                raise DataError(
                    f"the checkpoint's prompt sampler has {key}={state[key]} but this run has "
                    f"{key}={current}; resume with the same data files, max_prompt_length and seed "
                    "or start a new run"
                )
        position = int(state["position"])
        if not 0 <= position <= len(self._records):
            raise DataError(
                f"the checkpoint's prompt sampler position={position} is outside 0..{len(self._records)}; "
                "the checkpoint is corrupt or from another dataset"
            )
        self._epoch = int(state["epoch"])
        self._position = position
        self._order = self._epoch_order(self._epoch)
