"""The embedded task of the default CPU run: integer arithmetic with verifiable answers.

A tiny model cannot learn competition math on a laptop, but it can learn to add,
subtract and multiply small numbers, and the DAPO machinery does not care which
problems it scores: prompts end with the DAPO-Math-17K instruction (final answer on
its own last line as "Answer: <number>"), ground truths are integer strings, and the
math_dapo verifier scores responses exactly as it scores DAPO-Math-17K.

What is written (`prepare_arithmetic_task`):
- train / val prompt files in the plain jsonl schema {prompt, answer, data_source};
  validation problems never appear in the train or SFT files;
- an SFT corpus of short worked solutions for the warm start (column by column for + and -:
  "5+2=7\\n3+1=4\\nAnswer: 47" for 35+12; "7*8=56\\nAnswer: 56" for products)
  that teaches the answer format, so RL starts between "never right" and "always
  right" (groups with mixed accuracy are what dynamic sampling keeps);
- the sentencepiece tokenizer trained on all of it (see `tokenizer.py`).

Difficulty is the `ArithmeticMix`: weights of the problem kinds and operand sizes.
Everything is drawn from `random.Random` seeded per split, so the same seed writes
byte-identical files on any machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.data.tokenizer import SentencePieceSettings, load_or_train_sentencepiece
from megatron_dapo.tools.formats import RESULT_PAD, pad_result

DATA_SOURCE = "arithmetic"

# Paraphrase of the DAPO-Math-17K instruction, kept short for a small context window.
INSTRUCTION = 'Give the final answer on its own last line as "Answer: <number>".'

PROBLEM_KINDS = ("add", "sub", "mul", "two_step", "big_mul")

CALC_MARKERS = ("<calc>", "</calc>", "<result>", "</result>")
"""The `tags` tool format's markers (tools/formats.py), single pieces of a tool task's tokenizer."""


@dataclass(kw_only=True, slots=True)
class ArithmeticMix:
    """How hard the problems are: relative weights of the kinds and operand ranges."""

    add: float = 0.3
    """Weight of a+b."""
    sub: float = 0.3
    """Weight of a-b."""
    mul: float = 0.2
    """Weight of a*b with small factors."""
    two_step: float = 0.2
    """Weight of two operations with parentheses, e.g. (12+7)*3 or 45-(3+4); their
    operands have at most min(max_digits, 2) digits, a multiplier is one digit."""
    big_mul: float = 0.0
    """Weight of a*b with a 3-digit and a 2-digit factor (100..999 x 11..99): beyond a tiny
    model's head, within a calculator's (the tool task, examples/tiny_tools_cpu.yaml)."""
    max_digits: int = 2
    """Operands of +/- have 1..max_digits digits, the count drawn uniformly."""
    max_factor: int = 12
    """Factors of a*b lie in 2..max_factor; the multiplier in two-step problems in 2..9."""
    allow_negative: bool = False
    """False redraws problems whose answer or intermediate result is negative."""
    solution_style: str = "columns"
    """Worked solutions of +/-: "columns" (one line per digit column, see `column_lines`)
    or "direct" ("12+35=47")."""

    def __post_init__(self) -> None:
        weights = {kind: getattr(self, kind) for kind in PROBLEM_KINDS}
        bad = {kind: w for kind, w in weights.items() if w < 0}
        if bad or sum(weights.values()) <= 0:
            raise ValueError(
                f"ArithmeticMix weights {weights} must be >= 0 with a positive sum; "
                "set at least one of add/sub/mul/two_step/big_mul above 0"
            )
        if self.solution_style not in ("columns", "direct"):
            raise ValueError(f"ArithmeticMix.solution_style={self.solution_style!r} must be 'columns' or 'direct'")
        if not 1 <= self.max_digits <= 6:
            raise ValueError(f"ArithmeticMix.max_digits={self.max_digits} must be in 1..6")
        if self.max_factor < 2:
            raise ValueError(f"ArithmeticMix.max_factor={self.max_factor} must be >= 2")


@dataclass(kw_only=True, slots=True)
class ArithmeticProblem:
    """One problem with its worked solution steps."""

    expression: str
    """The expression as shown in the prompt, e.g. "(12+7)*3"."""
    steps: list[str]
    """Intermediate forms after the expression, e.g. ["19*3", "57"]; the last is the answer."""
    answer: int
    """The value of the expression."""
    kind: str
    """One of PROBLEM_KINDS."""
    lines: list[str] | None = None
    """Column-by-column working (`column_lines`), replacing `steps` in the solution."""
    calc: bool = False
    """The worked solution calls the calculator (tags format) instead of writing the value."""
    drill_result: int | None = None
    """A copy drill's tool result (`copy_drills`): the calling solution shows this value in the result
    span and copies it into the answer line, instead of the answer."""
    result_width: int = 0
    """The calling solution's result span is padded to this many characters, as the tool's answers
    are under tools.result_width (tools/formats.pad_result); 0 = unpadded."""

    def prompt(self) -> str:
        """The prompt text: the question, then the answer-format instruction."""
        return f"Compute {self.expression}.\n{INSTRUCTION}\n"

    def solution(self) -> str:
        """A short worked solution ending with the DAPO answer line."""
        if self.calc:
            open_, close, result_open, result_close = CALC_MARKERS
            shown = self.answer if self.drill_result is None else self.drill_result
            return f"{open_}{self.expression}{close}{result_open}{pad_result(str(shown), self.result_width)}" \
                   f"{result_close}\nAnswer: {shown}"
        if self.lines:
            return "\n".join(self.lines) + f"\nAnswer: {self.answer}"
        return "=".join([self.expression, *self.steps]) + f"\nAnswer: {self.answer}"


def column_lines(a: int, op: str, b: int) -> list[str]:
    """Schoolbook working of a+b or a-b (a >= b >= 0), one line per digit column, units first.

    Every line is a one-digit fact (with the carry or borrow written out), so a small model
    that has learned those ~200 facts can work out sums it has never seen; the answer line
    then reads the result digits back, most significant first. Examples:
    47+38 -> ["7+8=15", "4+3+1=8"]; 52-17 -> ["12-7=5", "5-1-1=3"]; 9+5 -> ["9+5=14"].

    Args:
        a: first operand (>= 0).
        op: "+" or "-".
        b: second operand (>= 0; <= a for "-").

    Returns:
        One line per column of the longer operand.
    """
    assert a >= 0 and b >= 0 and (op == "+" or a >= b), (a, op, b)
    width = max(len(str(a)), len(str(b)))
    lines, carry = [], 0
    for i in range(width):
        x, y = a // 10**i % 10, b // 10**i % 10
        extra = f"{op}1" if carry else ""
        if op == "+":
            total = x + y + carry
            lines.append(f"{x}+{y}{extra}={total}")
            carry = total // 10
        else:
            top = x - carry
            borrow = top < y
            lines.append(f"{x + 10 if borrow else x}-{y}{extra}={top + 10 * borrow - y}")
            carry = int(borrow)
    return lines


def _operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def _draw_two_step(rng: random.Random, mix: ArithmeticMix) -> tuple[ArithmeticProblem, int]:
    # One +/- pair of small operands and one operation with a third operand; a
    # multiplication always takes a one-digit multiplier to keep products short.
    inner_op = rng.choice("+-")
    outer_op = rng.choice("+-*")
    a = _operand(rng, min(mix.max_digits, 2))
    b = _operand(rng, min(mix.max_digits, 2))
    c = rng.randint(2, 9) if outer_op == "*" else _operand(rng, min(mix.max_digits, 2))
    inner = _apply(a, inner_op, b)
    # Parenthesized, a negative intermediate reads "3-(-4)", never "3--4".
    inner_text = f"({inner})" if inner < 0 else str(inner)
    if rng.random() < 0.5:
        expression = f"({a}{inner_op}{b}){outer_op}{c}"
        middle = f"{inner_text}{outer_op}{c}"
        answer = _apply(inner, outer_op, c)
    else:
        expression = f"{c}{outer_op}({a}{inner_op}{b})"
        middle = f"{c}{outer_op}{inner_text}"
        answer = _apply(c, outer_op, inner)
    problem = ArithmeticProblem(
        expression=expression, steps=[middle, str(answer)], answer=answer, kind="two_step"
    )
    return problem, inner


def draw_problem(rng: random.Random, mix: ArithmeticMix) -> ArithmeticProblem:
    """Draws one problem of a kind chosen by the mix weights.

    Args:
        rng: the split's random generator.
        mix: difficulty settings.

    Returns:
        The problem; with `allow_negative` False its answer and intermediate are >= 0.
    """
    # The kind is drawn once and only its operands are redrawn, so rejecting negative
    # results does not shift the mix away from its weights.
    kind = rng.choices(PROBLEM_KINDS, weights=[getattr(mix, k) for k in PROBLEM_KINDS])[0]
    return draw_problem_of_kind(rng, mix, kind)


def draw_problem_of_kind(rng: random.Random, mix: ArithmeticMix, kind: str) -> ArithmeticProblem:
    """Draws one problem of the given kind (one of PROBLEM_KINDS); see `draw_problem`."""
    if kind == "two_step":
        while True:
            problem, inner = _draw_two_step(rng, mix)
            if mix.allow_negative or (problem.answer >= 0 and inner >= 0):
                return problem
    if kind == "mul":
        a, b = rng.randint(2, mix.max_factor), rng.randint(2, mix.max_factor)
    elif kind == "big_mul":
        a, b = rng.randint(100, 999), rng.randint(11, 99)
        return ArithmeticProblem(expression=f"{a}*{b}", steps=[str(a * b)], answer=a * b, kind=kind)
    else:
        a, b = _operand(rng, mix.max_digits), _operand(rng, mix.max_digits)
        if kind == "sub" and not mix.allow_negative and a < b:
            a, b = b, a
    op = {"add": "+", "sub": "-", "mul": "*"}[kind]
    answer = _apply(a, op, b)
    lines = column_lines(a, op, b) if mix.solution_style == "columns" and op != "*" and answer >= 0 else None
    return ArithmeticProblem(expression=f"{a}{op}{b}", steps=[str(answer)], answer=answer, kind=kind, lines=lines)


def balance_product_digits(problems: list[ArithmeticProblem], mix: ArithmeticMix, rng: random.Random,
                           exclude: frozenset[str] = frozenset()) -> list[ArithmeticProblem]:
    """The big_mul products redrawn so that half have a 4-digit result and half a 5-digit one.

    Drawn as the mix does, 17% of 3-digit x 2-digit products are under 10,000; a warm start
    that has seen mostly 5-digit results copies a tool's answer by position, so every 4-digit
    result is miscopied into the answer line, all eight responses of such a prompt are wrong and
    dynamic sampling drops its group: RL never sees a rewarded one (docs/benchmarks.md, issue
    63). Each product keeps its place (and its `calc`) and gets operands with the drawn length.
    """
    out = []
    for p in problems:
        if p.kind != "big_mul":
            out.append(p)
            continue
        short = rng.random() < 0.5
        while True:
            q = draw_problem_of_kind(rng, mix, "big_mul")
            if (q.answer < 10_000) == short and q.expression not in exclude:
                break
        out.append(dataclasses.replace(q, calc=p.calc))
    return out


DRILL_DIGITS = ("product", "mixed")
"""How a copy drill's result is drawn (`copy_drills`)."""
MIXED_DRILL_WIDTHS = (3, 4, 5, 6)
MIXED_DRILL_REPEAT = 1 / 3
"""A "mixed" drill's width is uniform over MIXED_DRILL_WIDTHS; each digit after the first repeats the
one before it with probability MIXED_DRILL_REPEAT (a 5-digit drill has a doubled digit 87% of the
time, against 34% for uniform digits)."""


def drill_result(rng: random.Random, answer: int, digits: str = "product") -> int:
    """One copy drill's tool result: uniform among the numbers of the answer's width ("product"), or
    ("mixed") of a width drawn from MIXED_DRILL_WIDTHS with doubled digits at any position."""
    if digits == "product":
        width = len(str(answer))
        return rng.randint(10 ** (width - 1), 10**width - 1)
    if digits != "mixed":
        raise ValueError(f"drill digits {digits!r}: expected one of {DRILL_DIGITS}")
    out = [rng.randint(1, 9)]
    for _ in range(rng.choice(MIXED_DRILL_WIDTHS) - 1):
        out.append(out[-1] if rng.random() < MIXED_DRILL_REPEAT else rng.randint(0, 9))
    return int("".join(map(str, out)))


def copy_drills(problems: list[ArithmeticProblem], share: float, rng: random.Random,
                digits: str = "product") -> None:
    """Turns `share` of the calling solutions into copy drills, in place: each gets a tool result
    (`drill_result`): by default uniform among the numbers with as many digits as its answer.

    In a true solution the answer line repeats the result span, but it is also the product of the
    operands the policy has just copied, and a warm start can settle on a copy that reads the
    result's first digit and then continues from where that digit stands in the operands
    (`<result>37980</result>` -> `Answer: 33980`, "3" followed by "3" in 633). In a drill the answer
    can come from the result span only, so that copy loses on every drill, not on a few products.
    Drills of the product's width leave other local copies standing: a warm start then copied every
    5-digit result and no 4-digit one, or, drilled on 4 and 5 digits evenly, looked up the digit it
    had just written in the result span and wrote the one after it, which skips or loops on a doubled
    digit (`90090` -> `90900`). "mixed" drills vary the width and double digits at every position,
    so only a copy by position is right on all of them (docs/benchmarks.md, issue 63).
    Only the SFT corpus has drills; the RL and held-out prompts are scored against true answers.
    """
    for p in problems:
        if p.calc and rng.random() < share:
            p.drill_result = drill_result(rng, p.answer, digits)


class ColumnBalancer:
    """Chooses, among candidate problems of one kind, the one whose column facts were taught least.

    Drawn naturally, a two-digit sum's tens column with a carry ("5+6+1=12") needs two
    two-digit operands and a carry out of the units: each of the ~100 carry facts appears
    about twice in a 4,000-problem corpus, the plain facts up to ~100 times (every units
    column and every one-digit problem has one). A warm start stopped in its accuracy band
    then knows the plain facts and not the carries, and RL cannot teach a fact its sampler
    never writes (docs/benchmarks.md, issue 27). Picking the least-seen candidate evens the
    facts out; the kinds keep the mix's weights, since only operands are redrawn. Operand
    lengths do not: the rare facts live in two-column problems, so one-column +/- problems
    fall from about 26% to about 6% of the corpus (the RL prompts and held-out split keep the mix).
    """

    def __init__(self, candidates: int) -> None:
        """Args:
            candidates: problems drawn per pick (>= 2); more evens the facts out further.
        """
        assert candidates >= 2, candidates
        self.candidates = candidates
        self.counts: dict[tuple[int, str], int] = {}

    def pick(self, rng: random.Random, mix: ArithmeticMix, first: ArithmeticProblem,
             allowed: Callable[[ArithmeticProblem], bool]) -> ArithmeticProblem:
        """`first` or one of `candidates - 1` more problems of its kind, whichever has the rarest column fact."""
        if not first.lines:
            return first
        pool = [first, *(draw_problem_of_kind(rng, mix, first.kind) for _ in range(self.candidates - 1))]
        pool = [p for p in pool if p.lines and allowed(p)] or [first]

        def rarity(p: ArithmeticProblem) -> tuple[int, int]:
            seen = [self.counts.get(key, 0) for key in self.keys(p)]
            return min(seen), sum(seen)

        chosen = min(pool, key=rarity)
        for key in self.keys(chosen):
            self.counts[key] = self.counts.get(key, 0) + 1
        return chosen

    @staticmethod
    def keys(p: ArithmeticProblem) -> list[tuple[int, str]]:
        """A fact in its column: "3+1=4" in the tens column and in the units column are two keys, so
        balancing carries does not teach the tens column that a carry always comes."""
        return list(enumerate(p.lines or ()))


def generate_problems(
    num_problems: int,
    mix: ArithmeticMix,
    seed: int | str,
    exclude: frozenset[str] = frozenset(),
    unique: bool = False,
    balance_columns: int = 0,
) -> list[ArithmeticProblem]:
    """Draws `num_problems` problems deterministically from `seed`.

    Args:
        num_problems: how many to draw.
        mix: difficulty settings.
        seed: seeds a private `random.Random`; equal seeds give equal problems.
        exclude: expressions never returned (e.g. the validation set's).
        unique: no expression is returned twice.
        balance_columns: 0 or 1 draws problems as the mix does; k >= 2 takes, for each +/-
            problem, the least-taught of k of its kind (`ColumnBalancer`).

    Returns:
        The problems, in draw order.
    """
    rng = random.Random(seed)
    problems: list[ArithmeticProblem] = []
    seen: set[str] = set()
    balancer = ColumnBalancer(balance_columns) if balance_columns >= 2 else None

    def allowed(p: ArithmeticProblem) -> bool:
        return p.expression not in exclude and not (unique and p.expression in seen)

    # A mix with a tiny problem space (1-digit sums only) cannot fill a large unique
    # split; give up with a clear error instead of looping forever.
    max_draws = 100 * num_problems + 10_000
    for _ in range(max_draws):
        if len(problems) == num_problems:
            return problems
        problem = draw_problem(rng, mix)
        if not allowed(problem):
            continue
        if balancer is not None:
            problem = balancer.pick(rng, mix, problem, allowed)
        seen.add(problem.expression)
        problems.append(problem)
    if len(problems) == num_problems:
        return problems
    raise ValueError(
        f"could draw only {len(problems)} of {num_problems} distinct arithmetic problems from {mix} "
        f"in {max_draws} tries; lower the number of problems or raise max_digits / max_factor"
    )


def _write_jsonl_atomic(path: Path, rows: Iterable[dict]) -> None:
    # Ranks or reruns writing the same file must never expose a half-written one.
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp_name, path)


def _prompt_row(problem: ArithmeticProblem) -> dict:
    return {
        "prompt": problem.prompt(),
        "answer": str(problem.answer),
        "data_source": DATA_SOURCE,
        "extra_info": {"kind": problem.kind, "expression": problem.expression},
    }


@dataclass(kw_only=True, slots=True)
class ArithmeticTask:
    """Paths of everything `prepare_arithmetic_task` wrote."""

    train_path: Path
    """RL train prompts (plain jsonl schema)."""
    val_path: Path
    """Validation prompts, disjoint from train and SFT."""
    sft_path: Path
    """SFT corpus: rows {prompt, response, answer}."""
    tokenizer_path: Path
    """The sentencepiece model (`load_tokenizer` reads it)."""


def prepare_arithmetic_task(
    out_dir: str | Path,
    mix: ArithmeticMix,
    num_train: int,
    num_val: int,
    num_sft: int,
    seed: int,
    tokenizer_settings: SentencePieceSettings,
    sft_balance_columns: int = 0,
    train_balance_columns: int = 0,
    sft_tool_share: float = 0.0,
    sft_balance_product_digits: bool = False,
    sft_copy_drills: float = 0.0,
    sft_copy_drill_digits: str = "product",
    result_width: int = 0,
) -> ArithmeticTask:
    """Writes the train/val/SFT files of the arithmetic task and builds its tokenizer.

    Args:
        out_dir: directory for train.jsonl, val.jsonl, sft.jsonl and tokenizer/.
        mix: difficulty settings (shared by all splits).
        num_train: RL train prompts.
        num_val: validation prompts (all distinct).
        num_sft: worked solutions for the warm start.
        seed: seeds every split; the same seed rewrites identical files.
        tokenizer_settings: how the tokenizer is trained; it is cached by settings and corpus.
        sft_balance_columns: `generate_problems`' balance_columns for the SFT split only.
        train_balance_columns: the same for the RL train split (the held-out split keeps the mix).
        sft_tool_share: the share of big_mul worked solutions that call the calculator (the warm
            start teaches the call format; RL then teaches when to call). The tokenizer of a task
            with big_mul problems or calls has the format's markers as single pieces.
        sft_balance_product_digits: the SFT corpus's big_mul products have 4-digit and 5-digit
            results in equal shares (`balance_product_digits`); the other splits keep the mix.
        sft_copy_drills: the share of the SFT corpus's calling solutions that are copy drills
            (`copy_drills`: a random tool result, copied into the answer line).
        sft_copy_drill_digits: how the drills' results are drawn (`drill_result`).
        result_width: the SFT corpus's result spans are padded to this many characters, as the
            tool's answers are (tools.result_width); the tokenizer then has the pad as one piece.

    Returns:
        The paths written.
    """
    for name, value in (("num_train", num_train), ("num_val", num_val), ("num_sft", num_sft)):
        if value <= 0:
            raise ValueError(f"{name}={value} must be positive")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    val = generate_problems(num_val, mix, seed=f"{seed}:val", unique=True)
    held_out = frozenset(p.expression for p in val)

    def split(name: str, count: int, balance: int) -> tuple[list[ArithmeticProblem], list[ArithmeticProblem]]:
        """(the split as written, the split as the mix draws it)."""
        drawn = generate_problems(count, mix, seed=f"{seed}:{name}", exclude=held_out)
        if balance < 2:
            return drawn, drawn
        return generate_problems(count, mix, seed=f"{seed}:{name}", exclude=held_out, balance_columns=balance), drawn

    train, drawn_train = split("train", num_train, train_balance_columns)
    sft, drawn_sft = split("sft", num_sft, sft_balance_columns)
    if sft_tool_share > 0:
        calls = random.Random(f"{seed}:sft-calls")
        for p in sft:
            p.calc = p.kind == "big_mul" and calls.random() < sft_tool_share
    if sft_balance_product_digits:  # after the calls: the tokenizer's corpus (the drawn split) keeps them
        sft = balance_product_digits(sft, mix, random.Random(f"{seed}:sft-digits"), exclude=held_out)
    if sft_copy_drills > 0:  # the SFT file only: the tokenizer's corpus (the drawn split) shows true results
        sft = [dataclasses.replace(p) for p in sft]
        copy_drills(sft, sft_copy_drills, random.Random(f"{seed}:sft-drills"), sft_copy_drill_digits)
    if result_width > 0:  # the SFT file only, as the drills: the tokenizer's corpus keeps what it had
        sft = [dataclasses.replace(p, result_width=result_width) for p in sft]
    if mix.big_mul > 0 or sft_tool_share > 0:
        # Each pad is then its own token, so a padded result is always result_width tokens long.
        symbols = (*CALC_MARKERS, RESULT_PAD) if result_width > 0 else CALC_MARKERS
        tokenizer_settings = dataclasses.replace(tokenizer_settings, user_defined_symbols=symbols)
    # The tokenizer learns from the splits as the mix draws them: balancing the SFT corpus or the RL
    # prompts leaves it (and every checkpoint trained with it) as it was, so older runs resume and
    # evaluate unchanged.
    corpus = [text for p in (*drawn_train, *val, *drawn_sft) for text in (p.prompt(), p.solution())]
    tokenizer = load_or_train_sentencepiece(corpus, out_dir / "tokenizer", tokenizer_settings)
    task = ArithmeticTask(
        train_path=out_dir / "train.jsonl",
        val_path=out_dir / "val.jsonl",
        sft_path=out_dir / "sft.jsonl",
        tokenizer_path=tokenizer.model_path,
    )
    _write_jsonl_atomic(task.train_path, (_prompt_row(p) for p in train))
    _write_jsonl_atomic(task.val_path, (_prompt_row(p) for p in val))
    _write_jsonl_atomic(
        task.sft_path,
        ({"prompt": p.prompt(), "response": p.solution(),
          "answer": str(p.answer if p.drill_result is None else p.drill_result)} for p in sft),
    )
    return task
