"""The embedded arithmetic task: determinism, correct answers, disjoint validation, files, tokenizer."""

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.data.arithmetic import (
    DATA_SOURCE,
    INSTRUCTION,
    PROBLEM_KINDS,
    ArithmeticMix,
    column_lines,
    generate_problems,
    prepare_arithmetic_task,
)
from megatron_dapo.data.datasets import load_prompt_dataset
from megatron_dapo.data.tokenizer import SentencePieceSettings, load_tokenizer

TOKEN = re.compile(r"\d+|[-+*()]")


def evaluate(expression: str) -> int:
    """Recursive-descent evaluator of + - * and parentheses over non-negative integers."""
    tokens = TOKEN.findall(expression)
    assert "".join(tokens) == expression, expression
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def atom() -> int:
        token = take()
        if token == "(":
            value = expr()
            assert take() == ")"
            return value
        if token == "-":
            return -atom()
        return int(token)

    def term() -> int:
        value = atom()
        while peek() == "*":
            take()
            value *= atom()
        return value

    def expr() -> int:
        value = term()
        while peek() in ("+", "-"):
            value = value + term() if take() == "+" else value - term()
        return value

    result = expr()
    assert pos == len(tokens), expression
    return result


def test_evaluator_itself() -> None:
    assert [evaluate(e) for e in ("12+35", "7-(3-8)", "(4-9)*3", "2*3+4", "6-(-4)")] == [47, 12, -15, 10, 10]


def test_answers_and_worked_steps_are_correct() -> None:
    mix = ArithmeticMix(add=1, sub=1, mul=1, two_step=2, max_digits=3, allow_negative=True)
    problems = generate_problems(2000, mix, seed=5)
    assert {p.kind for p in problems} == {"add", "sub", "mul", "two_step"}
    for p in problems:
        assert evaluate(p.expression) == p.answer
        # Each intermediate line of the worked solution has the same value.
        assert [evaluate(step) for step in p.steps] == [p.answer] * len(p.steps)
        assert p.solution().endswith(f"\nAnswer: {p.answer}")
    assert any(p.answer < 0 for p in problems)


def test_no_negatives_unless_allowed_and_operand_ranges() -> None:
    problems = generate_problems(2000, ArithmeticMix(max_digits=2, max_factor=12), seed=1)
    assert min(p.answer for p in problems) >= 0
    assert all("(-" not in step for p in problems for step in p.steps)
    for p in problems:
        numbers = [int(n) for n in re.findall(r"\d+", p.expression)]
        if p.kind == "mul":
            assert all(2 <= n <= 12 for n in numbers)
        else:
            assert all(0 <= n <= 99 for n in numbers)


def test_mix_weights_pick_kinds() -> None:
    problems = generate_problems(3000, ArithmeticMix(add=3, sub=1, mul=0, two_step=0), seed=2)
    counts = {k: sum(p.kind == k for p in problems) for k in ("add", "sub", "mul", "two_step")}
    assert counts["mul"] == counts["two_step"] == 0
    assert 0.70 < counts["add"] / 3000 < 0.80


def test_generation_is_deterministic_and_seed_dependent() -> None:
    mix = ArithmeticMix()
    a = [p.solution() for p in generate_problems(200, mix, seed=7)]
    assert a == [p.solution() for p in generate_problems(200, mix, seed=7)]
    assert a != [p.solution() for p in generate_problems(200, mix, seed=8)]


def test_small_problem_space_fails_clearly() -> None:
    mix = ArithmeticMix(add=1, sub=0, mul=0, two_step=0, max_digits=1)
    assert len(generate_problems(100, mix, seed=0, unique=True)) == 100  # every a+b with a, b in 0..9
    with pytest.raises(ValueError, match=r"could draw only 100 of 101 distinct arithmetic problems"):
        generate_problems(101, mix, seed=0, unique=True)


def test_bad_mix_names_the_values() -> None:
    with pytest.raises(ValueError) as err:
        ArithmeticMix(add=0, sub=0, mul=0, two_step=0)
    assert str(err.value) == (
        "ArithmeticMix weights {'add': 0, 'sub': 0, 'mul': 0, 'two_step': 0, 'big_mul': 0.0} must be >= 0 with a "
        "positive sum; set at least one of add/sub/mul/two_step/big_mul above 0"
    )


def test_the_tool_task_draws_big_products_and_shows_the_call_format(tmp_path: Path) -> None:
    """big_mul problems (3-digit x 2-digit) and the warm start's calculator solutions (issue 40)."""
    import json

    mix = ArithmeticMix(add=0.5, sub=0.0, mul=0.0, two_step=0.0, big_mul=0.5)
    problems = generate_problems(200, mix, seed=3)
    big = [p for p in problems if p.kind == "big_mul"]
    assert big and all(100 <= int(p.expression.split("*")[0]) <= 999 and 11 <= int(p.expression.split("*")[1]) <= 99
                       for p in big)
    assert problems == generate_problems(200, mix, seed=3)
    # A mix without big_mul draws what it drew before the kind existed: its zero weight comes last,
    # which leaves random.choices' cumulative weights, and so every draw, as they were.
    import random

    weights = [0.3, 0.3, 0.2, 0.2]
    before, after = random.Random(9), random.Random(9)
    assert [before.choices(PROBLEM_KINDS[:4], weights=weights)[0] for _ in range(500)] == \
        [after.choices(PROBLEM_KINDS, weights=[*weights, 0.0])[0] for _ in range(500)]
    assert PROBLEM_KINDS[-1] == "big_mul"
    task = prepare_arithmetic_task(tmp_path, mix, num_train=50, num_val=20, num_sft=200, seed=1,
                                   tokenizer_settings=SentencePieceSettings(), sft_tool_share=1.0)
    rows = [json.loads(line) for line in task.sft_path.read_text().splitlines()]
    calls = [r for r in rows if "<calc>" in r["response"]]
    assert calls and all("*" in r["prompt"] for r in calls)
    a, b = calls[0]["prompt"].split("Compute ")[1].split(".")[0].split("*")
    assert calls[0]["response"] == f"<calc>{a}*{b}</calc><result>{int(a) * int(b)}</result>\nAnswer: {int(a) * int(b)}"
    from megatron_dapo.data.tokenizer import load_tokenizer

    tok = load_tokenizer(task.tokenizer_path)
    assert all(len(tok.encode(m)) == 1 for m in ("<calc>", "</calc>", "<result>", "</result>"))


def test_prepare_task_files_and_tokenizer(tmp_path: Path) -> None:
    settings = SentencePieceSettings()
    task = prepare_arithmetic_task(
        tmp_path,
        ArithmeticMix(),
        num_train=300,
        num_val=50,
        num_sft=200,
        seed=11,
        tokenizer_settings=settings,
    )
    first_bytes = [p.read_bytes() for p in (task.train_path, task.val_path, task.sft_path)]
    again = prepare_arithmetic_task(
        tmp_path,
        ArithmeticMix(),
        num_train=300,
        num_val=50,
        num_sft=200,
        seed=11,
        tokenizer_settings=settings,
    )
    assert [p.read_bytes() for p in (again.train_path, again.val_path, again.sft_path)] == first_bytes
    assert again.tokenizer_path == task.tokenizer_path

    train = [json.loads(line) for line in task.train_path.read_text().splitlines()]
    val = [json.loads(line) for line in task.val_path.read_text().splitlines()]
    sft = [json.loads(line) for line in task.sft_path.read_text().splitlines()]
    assert (len(train), len(val), len(sft)) == (300, 50, 200)
    val_expressions = {r["extra_info"]["expression"] for r in val}
    assert len(val_expressions) == 50
    train_expressions = {r["extra_info"]["expression"] for r in train}
    assert not val_expressions & train_expressions
    for row in train + val:
        assert row["data_source"] == DATA_SOURCE
        assert row["prompt"].endswith(INSTRUCTION + "\n")
        assert str(evaluate(row["extra_info"]["expression"])) == row["answer"]
    for row in sft:
        assert row["response"].splitlines()[-1] == f"Answer: {row['answer']}"

    tokenizer = load_tokenizer(task.tokenizer_path)
    # Digits are single tokens, so a model can learn carries digit by digit.
    assert [tokenizer.decode([t]) for t in tokenizer.encode("1234")] == ["1", "2", "3", "4"]
    ds = load_prompt_dataset(task.val_path, tokenizer, max_prompt_length=64)
    assert len(ds) == 50 and ds.records[0].ground_truth == val[0]["answer"]
    assert max(len(r.prompt_ids) for r in ds.records) <= 40


def _check_column_working(a: int, op: str, b: int) -> None:
    lines = column_lines(a, op, b)
    assert len(lines) == max(len(str(a)), len(str(b)))
    digits = []
    for line in lines:
        lhs, rhs = line.split("=")
        terms = [int(t) for t in lhs.replace("-", "+-").split("+") if t]
        # Each line is a true one-column fact: its left side evaluates to its right side.
        assert sum(terms) == int(rhs), line
        digits.append(int(rhs) % 10)
    top = int(lines[-1].split("=")[1])
    # Reading back: the last column's full value, then the other columns' units digits.
    read_back = int(str(top) + "".join(str(d) for d in reversed(digits[:-1])))
    assert read_back == (a + b if op == "+" else a - b)


def test_column_working_examples():
    assert column_lines(47, "+", 38) == ["7+8=15", "4+3+1=8"]
    assert column_lines(52, "-", 17) == ["12-7=5", "5-1-1=3"]
    assert column_lines(100, "-", 1) == ["10-1=9", "10-0-1=9", "1-0-1=0"]
    assert column_lines(3, "+", 47) == ["3+7=10", "0+4+1=5"]


@given(st.integers(0, 99999), st.integers(0, 99999), st.sampled_from("+-"))
@settings(max_examples=300, deadline=None)
def test_column_working_is_exact(a, b, op):
    if op == "-" and a < b:
        a, b = b, a
    _check_column_working(a, op, b)


def test_columns_style_solution_and_direct_style():
    cols = generate_problems(50, ArithmeticMix(add=1, sub=1, mul=0, two_step=0), seed=3)
    direct = generate_problems(50, ArithmeticMix(add=1, sub=1, mul=0, two_step=0, solution_style="direct"), seed=3)
    assert [p.expression for p in cols] == [p.expression for p in direct]
    for c, d in zip(cols, direct):
        assert c.solution().endswith(f"\nAnswer: {c.answer}")
        assert c.solution().split("\n")[:-1] == c.lines
        assert d.solution() == f"{d.expression}={d.answer}\nAnswer: {d.answer}"


def test_balanced_sft_teaches_every_column_fact_and_keeps_the_mix() -> None:
    # The default run's mix: drawn naturally, some carry facts of the tens column appear once in
    # 4,000 problems; the balancer brings every fact-in-column up while the kinds keep their weights
    # and the held-out expressions stay out.
    mix = ArithmeticMix(add=0.45, sub=0.45, mul=0.1, two_step=0.0, max_digits=2)
    held_out = frozenset(p.expression for p in generate_problems(128, mix, seed="val", unique=True))

    def column_counts(problems: list) -> dict:
        counts: dict = {}
        for p in problems:
            for key in enumerate(p.lines or ()):
                counts[key] = counts.get(key, 0) + 1
        return counts

    natural = generate_problems(4000, mix, seed="sft", exclude=held_out)
    balanced = generate_problems(4000, mix, seed="sft", exclude=held_out, balance_columns=8)
    assert min(column_counts(natural).values()) <= 2
    assert min(column_counts(balanced).values()) >= 5
    assert set(column_counts(balanced)) >= set(column_counts(natural))
    for kind, weight in (("add", 0.45), ("sub", 0.45), ("mul", 0.1)):
        share = sum(p.kind == kind for p in balanced) / len(balanced)
        assert abs(share - weight) < 0.03, (kind, share)
    assert not held_out & {p.expression for p in balanced}
    assert all(p.answer == evaluate(p.expression) for p in balanced)
    # Carries keep their natural share of the tens column: a tens column is not taught that a carry always comes.
    tens = [p.lines[1] for p in balanced if p.lines and len(p.lines) > 1]
    carried = sum(line.split("=")[0].count("+") + line.split("=")[0].count("-") == 2 for line in tens) / len(tens)
    assert 0.35 < carried < 0.55
    assert [p.expression for p in balanced] == [p.expression for p in generate_problems(
        4000, mix, seed="sft", exclude=held_out, balance_columns=8)]


@pytest.mark.parametrize("split", ["sft", "train"])
def test_balancing_a_split_keeps_the_tokenizer_and_the_other_splits(tmp_path: Path, split: str) -> None:
    # Checkpoints trained before a split was balanced must keep reading their tokens: the tokenizer
    # learns from the splits as the mix draws them. data.embedded.sft_balance_columns changes the SFT
    # corpus only, train_balance_columns the RL prompts only; the held-out split never changes.
    mix = ArithmeticMix(add=0.45, sub=0.45, mul=0.1, two_step=0.0, max_digits=2)
    settings = SentencePieceSettings(vocab_size=320)
    tasks = [prepare_arithmetic_task(tmp_path / str(k), mix, num_train=300, num_val=40, num_sft=300, seed=9,
                                     tokenizer_settings=settings, **{f"{split}_balance_columns": k}) for k in (0, 8)]
    assert tasks[0].tokenizer_path.read_bytes() == tasks[1].tokenizer_path.read_bytes()
    assert tasks[0].val_path.read_text() == tasks[1].val_path.read_text()
    for name in ("sft", "train"):
        same = getattr(tasks[0], f"{name}_path").read_text() == getattr(tasks[1], f"{name}_path").read_text()
        assert same == (name != split), name
    held_out = {json.loads(line)["extra_info"]["expression"] for line in tasks[1].val_path.read_text().splitlines()}
    train = [json.loads(line)["extra_info"]["expression"] for line in tasks[1].train_path.read_text().splitlines()]
    assert len(train) == 300 and not held_out & set(train)


def test_balanced_product_digits_even_out_4_and_5_digit_results_in_the_sft_corpus_only(tmp_path: Path) -> None:
    # Issue 63: drawn as the mix does, 17% of the products have a 4-digit result, and a warm start
    # copied every one of them into the answer line as if it had 5 digits.
    import random

    from megatron_dapo.data.arithmetic import balance_product_digits

    mix = ArithmeticMix(add=0.3, sub=0.3, mul=0.0, two_step=0.0, big_mul=0.4)
    drawn = generate_problems(3000, mix, seed="s")
    exclude = frozenset(p.expression for p in drawn[:500] if p.kind == "big_mul")
    balanced = balance_product_digits(drawn, mix, random.Random(0), exclude=exclude)
    products = [p for p in balanced if p.kind == "big_mul"]
    share = sum(p.answer < 10_000 for p in products) / len(products)
    assert sum(p.answer < 10_000 for p in drawn if p.kind == "big_mul") / len(products) < 0.2 < 0.45 < share < 0.55
    assert [p.kind for p in balanced] == [p.kind for p in drawn]
    assert [p for p in balanced if p.kind != "big_mul"] == [p for p in drawn if p.kind != "big_mul"]
    assert all(p.answer == eval(p.expression) and p.steps == [str(p.answer)] and p.expression not in exclude
               for p in products)
    settings = SentencePieceSettings(vocab_size=320)
    tasks = [prepare_arithmetic_task(tmp_path / str(on), mix, num_train=200, num_val=40, num_sft=400, seed=9,
                                     tokenizer_settings=settings, sft_tool_share=1.0, sft_balance_product_digits=on)
             for on in (False, True)]
    assert tasks[0].tokenizer_path.read_bytes() == tasks[1].tokenizer_path.read_bytes()
    for name in ("val", "train"):
        assert getattr(tasks[0], f"{name}_path").read_text() == getattr(tasks[1], f"{name}_path").read_text()
    rows = [json.loads(line) for line in tasks[1].sft_path.read_text().splitlines()]
    calls = [r for r in rows if "<calc>" in r["response"]]
    assert calls and sum(int(r["answer"]) < 10_000 for r in calls) / len(calls) > 0.35
    held_out = {json.loads(line)["extra_info"]["expression"] for line in tasks[1].val_path.read_text().splitlines()}
    assert not held_out & {r["prompt"].split("Compute ")[1].split(".")[0] for r in rows}


def test_copy_drills_show_a_random_result_and_copy_it_in_the_sft_corpus_only(tmp_path: Path) -> None:
    # Issue 63: a warm start (seed 6316) read the result's first digit and then continued from the
    # operands ("<result>37980</result>" -> "Answer: 33980"); in a drill only the result span has the answer.
    mix = ArithmeticMix(add=0.3, sub=0.3, mul=0.0, two_step=0.0, big_mul=0.4)
    settings = SentencePieceSettings(vocab_size=320)
    tasks = [prepare_arithmetic_task(tmp_path / str(share), mix, num_train=200, num_val=40, num_sft=1000, seed=9,
                                     tokenizer_settings=settings, sft_tool_share=1.0, sft_copy_drills=share)
             for share in (0.0, 0.5)]
    assert tasks[0].tokenizer_path.read_bytes() == tasks[1].tokenizer_path.read_bytes()
    for name in ("val", "train"):
        assert getattr(tasks[0], f"{name}_path").read_text() == getattr(tasks[1], f"{name}_path").read_text()
    plain, drilled = ([json.loads(line) for line in t.sft_path.read_text().splitlines()] for t in tasks)
    assert [r["prompt"] for r in plain] == [r["prompt"] for r in drilled]
    assert [r for r in plain if "<calc>" not in r["response"]] == [r for r in drilled if "<calc>" not in r["response"]]
    drills = 0
    for before, after in zip(plain, drilled):
        if "<calc>" not in before["response"]:
            continue
        true = eval(before["prompt"].split("Compute ")[1].split(".")[0])
        shown = int(after["response"].split("<result>")[1].split("</result>")[0])
        assert before["response"].endswith(f"<result>{true}</result>\nAnswer: {true}")
        assert after["response"].endswith(f"<result>{shown}</result>\nAnswer: {shown}") and after["answer"] == str(shown)
        assert len(str(shown)) == len(str(true))
        drills += shown != true
    calls = sum("<calc>" in r["response"] for r in plain)
    assert 0.4 < drills / calls < 0.6


def test_mixed_drills_vary_the_width_and_double_digits_at_every_position(tmp_path: Path) -> None:
    # Issue 63: drilled on the product's widths, warm starts copied no 4-digit result, or (4 and 5
    # digits evenly) skipped a doubled digit ("90090" -> "90900"); "mixed" drills break both copies.
    import random

    from megatron_dapo.data.arithmetic import MIXED_DRILL_WIDTHS, drill_result

    rng = random.Random(3)
    drawn = [str(drill_result(rng, 12345, "mixed")) for _ in range(4000)]
    assert {len(d) for d in drawn} == set(MIXED_DRILL_WIDTHS) and all(d[0] != "0" for d in drawn)
    for width in MIXED_DRILL_WIDTHS:
        share = sum(len(d) == width for d in drawn) / len(drawn)
        assert abs(share - 1 / len(MIXED_DRILL_WIDTHS)) < 0.04, (width, share)
    five = [d for d in drawn if len(d) == 5]
    for i in range(4):  # a doubled digit at each position, far more often than uniform digits (10%)
        assert sum(d[i] == d[i + 1] for d in five) / len(five) > 0.3, i
    rng = random.Random(3)
    assert all(len(str(drill_result(rng, a, "product"))) == len(str(a)) for a in (1000, 9999, 10000, 98901))
    with pytest.raises(ValueError, match="drill digits"):
        drill_result(rng, 1000, "even")

    mix = ArithmeticMix(add=0.3, sub=0.3, mul=0.0, two_step=0.0, big_mul=0.4)
    settings = SentencePieceSettings(vocab_size=320)
    tasks = [prepare_arithmetic_task(tmp_path / digits, mix, num_train=200, num_val=40, num_sft=1000, seed=9,
                                     tokenizer_settings=settings, sft_tool_share=1.0, sft_copy_drills=0.5,
                                     sft_copy_drill_digits=digits) for digits in ("product", "mixed")]
    assert tasks[0].tokenizer_path.read_bytes() == tasks[1].tokenizer_path.read_bytes()
    assert tasks[0].val_path.read_text() == tasks[1].val_path.read_text()
    widths = set()
    for row in (json.loads(line) for line in tasks[1].sft_path.read_text().splitlines()):
        if "<calc>" in row["response"]:
            shown = row["response"].split("<result>")[1].split("</result>")[0]
            assert row["response"].endswith(f"<result>{shown}</result>\nAnswer: {shown}") and row["answer"] == shown
            widths.add(len(shown))
    assert widths == set(MIXED_DRILL_WIDTHS)  # 3 and 6 digits come from drills only


def test_a_result_width_pads_the_sft_results_and_every_pad_is_one_token(tmp_path: Path) -> None:
    # The SFT corpus must show results as the tool answers them (tools.result_width), and a padded
    # result must be result_width tokens whatever its digits: the pad is a piece of its own.
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.tools.formats import RESULT_PAD

    mix = ArithmeticMix(add=0.3, sub=0.3, mul=0.0, two_step=0.0, big_mul=0.4)
    settings = SentencePieceSettings(vocab_size=320)
    plain, padded = (prepare_arithmetic_task(tmp_path / str(w), mix, num_train=200, num_val=40, num_sft=1000, seed=9,
                                             tokenizer_settings=settings, sft_tool_share=1.0, result_width=w)
                     for w in (0, 6))
    for name in ("val", "train"):
        assert getattr(plain, f"{name}_path").read_text() == getattr(padded, f"{name}_path").read_text()
    tok = load_tokenizer(str(padded.tokenizer_path))
    rows = [json.loads(line) for line in padded.sft_path.read_text().splitlines()]
    calls = [r for r in rows if "<calc>" in r["response"]]
    widths = set()
    for row in calls:
        span = row["response"].split("<result>")[1].split("</result>")[0]
        digits = span.rstrip(RESULT_PAD)
        assert len(span) == 6 and digits == row["answer"] and row["response"].endswith(f"\nAnswer: {digits}")
        assert len(tok.encode(f"<result>{span}</result>")) == 8, span
        widths.add(len(digits))
    assert widths == {4, 5}
    unpadded = [json.loads(line)["response"] for line in plain.sft_path.read_text().splitlines()]
    assert not any(RESULT_PAD in r for r in unpadded)
    assert [r["response"].replace(RESULT_PAD, "") for r in rows] == unpadded


def test_copy_drills_need_calling_solutions() -> None:
    from megatron_dapo.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config("examples/tiny_tools_cpu.yaml", ["data.embedded.sft_tool_share=0", "data.embedded.sft_copy_drills=0.5"])
    assert "data.embedded.sft_copy_drills" in str(err.value) and "sft_tool_share > 0" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"sft_copy_drills.*must be in"):
        load_config("examples/tiny_tools_cpu.yaml", ["data.embedded.sft_copy_drills=1.5"])
    with pytest.raises(ConfigError) as err:
        load_config("examples/tiny_tools_cpu.yaml", ["data.embedded.sft_copy_drill_digits=mixed"])
    assert "data.embedded.sft_copy_drill_digits" in str(err.value) and "sft_copy_drills > 0" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"tools.result_width.*must be >= 0"):
        load_config("examples/tiny_tools_cpu.yaml", ["tools.result_width=-1"])
