"""Turn the public math datasets a DAPO user starts from into the trainer's prompt schema.

    python tools/prepare_data.py --source dapo-math-17k --input dapo-math-17k.parquet --out train.parquet

Output rows are DAPO-Math-17K's schema, which data/datasets.py reads:
``{"data_source", "prompt": [{"role": "user", "content": <template applied>}], "ability",
"reward_model": {"ground_truth", "style"}, "extra_info": {"index", "source_row"}}``.

Input layouts (column names are matched exactly; each source's file as its publisher ships it,
.parquet, .jsonl or .json):

- ``dapo-math-17k``: (a) BytedTsinghua-SIA/DAPO-Math-17k's parquet (also what verl's
  recipe/dapo and examples/data_preprocess/dapo_multiturn_w_tool.py read): ``data_source``,
  ``prompt`` = [{"content", "role"}] with the DAPO instruction already around the problem,
  ``ability``, ``reward_model`` = {"ground_truth", "style"}, ``extra_info`` = {"index"};
  (b) the processed layout of open-r1/DAPO-Math-17k-Processed (its create_dataset.py):
  ``prompt`` = the first message's content as a string, ``solution`` = the ground truth,
  the original messages in ``source_prompt``. The instruction is stripped so that the
  chosen template is applied once. The original file repeats its problems (its card's size
  category is 1M-10M rows for about 17K problems): deduplication brings it back to 17K.
- ``aime2024``: (a) BytedTsinghua-SIA/AIME-2024 (the DAPO schema above, every problem
  repeated for avg@32); (b) HuggingFaceH4/aime_2024 / AI-MO/aimo-validation-aime
  (``id``, ``problem``, ``solution``, ``answer``, ``url``), and Maxwell-Jia/AIME_2024's
  capitalised ``ID``, ``Problem``, ``Solution``, ``Answer``.
- ``gsm8k``: openai/gsm8k (``question``, ``answer``). The reference answer is what
  follows the last "#### " of ``answer``, with thousands commas removed ("1,200" ->
  "1200"), as verl's examples/data_preprocess/gsm8k.py extracts it.
- ``math``: hendrycks/competition_math and its mirrors (``problem``, ``solution``,
  ``level``, ``type``). The reference answer is the content of the LAST ``\\boxed{...}``
  (or ``\\fbox{...}``) in ``solution``, braces matched, as verl's math_dataset.py does.

Deduplication keys on the problem text with whitespace collapsed; the first row wins.
A row that cannot be read raises DataError naming the file, the row and the column.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_dapo.data.errors import DataError

DAPO_INSTRUCTION_HEAD = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_INSTRUCTION_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'
TEMPLATES = {
    "dapo": DAPO_INSTRUCTION_HEAD + "{problem}" + DAPO_INSTRUCTION_TAIL,
    "none": "{problem}",
}
SOURCES = ("dapo-math-17k", "aime2024", "gsm8k", "math")
_GSM8K_MARK = "#### "


@dataclass(kw_only=True, slots=True)
class Problem:
    """One problem read from a source row."""

    problem: str
    """The problem statement, without any instruction."""
    answer: str
    """The reference answer."""
    row: int
    """0-based row in the input file."""


class RowError(ValueError):
    """A row's column cannot be read; the caller adds the file and row."""

    def __init__(self, column: str, message: str) -> None:
        super().__init__(message)
        self.column = column


# ---------------------------------------------------------------------------- answers


def gsm8k_answer(text: str) -> str:
    """The number after the last "#### " of a GSM8K answer, thousands commas removed."""
    if _GSM8K_MARK not in text:
        raise RowError("answer", "has no '#### <number>' line")
    answer = text.rsplit(_GSM8K_MARK, 1)[1].strip().replace(",", "")
    if not answer:
        raise RowError("answer", "is empty after '#### '")
    return answer


def last_boxed(text: str) -> str:
    r"""The content of the last \boxed{...} or \fbox{...} (braces matched), or of "\boxed x"."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\s*", text)]
    if not starts:
        raise RowError("solution", r"has no \boxed{...} answer")
    m = starts[-1]
    i = m.end()
    if i < len(text) and text[i] == "{":
        depth = 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1:j].strip()
        raise RowError("solution", r"has an unclosed \boxed{")
    # "\boxed 5": the answer runs to the next "$" or whitespace.
    token = re.match(r"[^\s$]+", text[i:])
    if token is None:
        raise RowError("solution", r"has an empty \boxed")
    return token.group(0)


def strip_dapo_instruction(content: str) -> str:
    """The problem inside DAPO's instruction (unchanged if the instruction is not there)."""
    if content.startswith(DAPO_INSTRUCTION_HEAD):
        content = content[len(DAPO_INSTRUCTION_HEAD):]
        if content.endswith(DAPO_INSTRUCTION_TAIL):
            content = content[: -len(DAPO_INSTRUCTION_TAIL)]
    return content.strip()


# ---------------------------------------------------------------------------- layouts


def _text(row: dict[str, Any], column: str) -> str:
    if column not in row:
        raise RowError(column, "is missing")
    value = row[column]
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(int(value)) if float(value).is_integer() else str(value)
    if not isinstance(value, str) or not value.strip():
        raise RowError(column, f"is {value!r}, expected non-empty text")
    return value


def _from_dapo_schema(row: dict[str, Any]) -> tuple[str, str]:
    messages = row["prompt"]
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        raise RowError("prompt", f"is {messages!r:.80}, expected a list of {{'role', 'content'}} messages")
    user = [m for m in messages if m.get("role") == "user"] or messages
    content = user[-1].get("content")
    if not isinstance(content, str) or not content.strip():
        raise RowError("prompt", "has no user message with text content")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise RowError("reward_model", f"is {reward_model!r:.80}, expected {{'ground_truth': ...}}")
    return strip_dapo_instruction(content), _text(reward_model, "ground_truth")


def read_dapo_math(row: dict[str, Any]) -> tuple[str, str]:
    """DAPO-Math-17K: the original messages layout, or the processed (prompt str, solution) one."""
    if isinstance(row.get("prompt"), str) and "solution" in row:
        return strip_dapo_instruction(_text(row, "prompt")), _text(row, "solution").strip()
    if "prompt" not in row:
        raise RowError("prompt", "is missing (expected DAPO-Math-17K's columns prompt + reward_model, or the "
                       "processed prompt + solution)")
    return _from_dapo_schema(row)


def read_aime(row: dict[str, Any]) -> tuple[str, str]:
    """AIME 2024: the DAPO schema, or problem/answer columns (any capitalisation)."""
    if isinstance(row.get("prompt"), list):
        return _from_dapo_schema(row)
    lower = {k.lower(): k for k in row}
    if "problem" not in lower or "answer" not in lower:
        raise RowError("problem" if "problem" not in lower else "answer",
                       "is missing (expected BytedTsinghua-SIA/AIME-2024's prompt + reward_model, or problem + answer)")
    return _text(row, lower["problem"]).strip(), _text(row, lower["answer"]).strip()


def read_gsm8k(row: dict[str, Any]) -> tuple[str, str]:
    return _text(row, "question").strip(), gsm8k_answer(_text(row, "answer"))


def read_math(row: dict[str, Any]) -> tuple[str, str]:
    return _text(row, "problem").strip(), last_boxed(_text(row, "solution"))


READERS: dict[str, Callable[[dict[str, Any]], tuple[str, str]]] = {
    "dapo-math-17k": read_dapo_math, "aime2024": read_aime, "gsm8k": read_gsm8k, "math": read_math,
}


# ---------------------------------------------------------------------------- files


def iter_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(0-based row, row) of a .parquet, .jsonl or .json (a list of objects) file."""
    suffix = path.suffix.lower()
    if not path.is_file():
        raise DataError(f"input file {path} does not exist")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
        yield from enumerate(table.to_pylist())
    elif suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path} row {i} (line {i + 1}): invalid JSON ({e.msg})") from None
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON list of row objects")
        yield from enumerate(rows)
    else:
        raise DataError(f"input file {path} has extension {path.suffix!r}; use .parquet, .jsonl or .json")


def read_problems(path: Path, source: str) -> list[Problem]:
    """Every problem of an input file in the source's layout.

    Raises:
        DataError: naming the file, the 0-based row and the column that cannot be read.
    """
    reader = READERS[source]
    problems = []
    for i, row in iter_rows(path):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {i}: is {type(row).__name__}, expected an object of columns")
        try:
            problem, answer = reader(row)
        except RowError as e:
            raise DataError(f"{path} row {i} column '{e.column}': {e} (--source {source}; layouts in "
                            "tools/prepare_data.py --help)") from None
        problems.append(Problem(problem=problem, answer=answer, row=i))
    if not problems:
        raise DataError(f"{path} has no rows")
    return problems


def dedup(problems: list[Problem]) -> list[Problem]:
    """First occurrence of each problem text (whitespace collapsed)."""
    seen: set[str] = set()
    kept = []
    for p in problems:
        key = " ".join(p.problem.split())
        if key not in seen:
            seen.add(key)
            kept.append(p)
    return kept


def to_rows(problems: list[Problem], source: str, template: str) -> list[dict[str, Any]]:
    """The trainer's DAPO-Math-17K schema."""
    data_source = "math_dapo" if source == "dapo-math-17k" else source
    return [{"data_source": data_source,
             "prompt": [{"role": "user", "content": template.replace("{problem}", p.problem)}],
             "ability": "MATH",
             "reward_model": {"ground_truth": p.answer, "style": "rule-math"},
             "extra_info": {"index": i, "source_row": p.row}} for i, p in enumerate(problems)]


def write_rows(rows: list[dict[str, Any]], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out)
    elif out.suffix.lower() == ".jsonl":
        out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    else:
        raise DataError(f"--out {out}: use a .parquet or .jsonl file")


def length_report(rows: list[dict[str, Any]], max_prompt_length: int, tokenizer: Any | None) -> str:
    """Prompt lengths against max_prompt_length: tokens with a tokenizer, else ~chars/4 (an estimate)."""
    if tokenizer is not None:
        lengths = [len(tokenizer.encode(tokenizer.render_chat(r["prompt"]))) for r in rows]
        unit = "tokens"
    else:
        lengths = [len(r["prompt"][0]["content"]) // 4 + 1 for r in rows]
        unit = "tokens (estimated as chars/4; pass --tokenizer for exact counts)"
    over = sum(n > max_prompt_length for n in lengths)
    q = statistics.quantiles(lengths, n=20) if len(lengths) > 1 else [lengths[0]] * 19
    return (f"prompt length in {unit}: min {min(lengths)}, mean {statistics.fmean(lengths):.1f}, "
            f"p50 {q[9]:.0f}, p95 {q[18]:.0f}, max {max(lengths)}; {over} of {len(lengths)} prompts exceed "
            f"max_prompt_length={max_prompt_length} and would be dropped by the trainer")


def resolve_template(value: str) -> str:
    """A template name (dapo, none), a file holding one, or the template text with {problem}."""
    if value in TEMPLATES:
        return TEMPLATES[value]
    text = Path(value).read_text(encoding="utf-8") if Path(value).is_file() else value
    if "{problem}" not in text:
        raise DataError(f"--template {value!r}: expected dapo, none, or text/a file containing {{problem}}")
    return text


def main(argv: list[str] | None = None) -> int:
    from megatron_dapo.errors import CliParser

    parser = CliParser(prog="prepare_data.py", description=__doc__.split("\n")[0],
                       epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, choices=SOURCES, help="which dataset the input file is")
    parser.add_argument("--input", required=True, type=Path, help="the downloaded .parquet/.jsonl/.json file")
    parser.add_argument("--out", required=True, type=Path, help="output .parquet or .jsonl in the trainer's schema")
    parser.add_argument("--template", default="dapo", help="prompt template: dapo (the paper's instruction, "
                        "default), none (the bare problem), or text/a file containing {problem}")
    parser.add_argument("--no-dedup", action="store_true", help="keep repeated problems")
    parser.add_argument("--max-prompt-length", type=int, default=2048, help="data.max_prompt_length to report against")
    parser.add_argument("--tokenizer", help="HF tokenizer directory or sentencepiece .model for exact token counts")
    args = parser.parse_args(argv)
    from megatron_dapo.errors import EXIT_USER_ERROR, UserError

    try:
        template = resolve_template(args.template)
        problems = read_problems(args.input, args.source)
        kept = problems if args.no_dedup else dedup(problems)
        rows = to_rows(kept, args.source, template)
        tokenizer = None
        if args.tokenizer:
            from megatron_dapo.data.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer)
        write_rows(rows, args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"{args.input}: {len(problems)} rows, {len(problems) - len(kept)} duplicates dropped, "
          f"{len(rows)} prompts written to {args.out}")
    print(length_report(rows, args.max_prompt_length, tokenizer))
    return 0
