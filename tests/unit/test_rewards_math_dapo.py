"""The DAPO-Math-17K verifier: hand-checked cases, strict box mode, bounded time."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.rewards.math_dapo import (
    MAX_GROUND_TRUTH_CHARS,
    TAIL_CHARS,
    compute_score,
    normalize_final_answer,
)

# (response, ground truth, correct?, normalized prediction), each checked by hand.
CASES = [
    # plain integers, the DAPO-Math-17K answer format
    ("The sum is 5.\nAnswer: 5", "5", True, "5"),
    ("Answer: 6", "5", False, "6"),
    ("answer: 34", "34", True, "34"),
    ("ANSWER : 34", "34", True, "34"),
    ("Final Answer: 34", "34", True, "34"),
    ("Answer:\n34", "34", True, "34"),  # \s* after the colon spans the line break
    ("Answer: 5", "  5 ", True, "5"),
    ("Answer: 12.", "12", True, "12"),
    ("Answer: 12", "12.", True, "12"),
    # TeX wrappers
    ("Answer: $34$", "34", True, "34"),
    ("Answer: \\boxed{34}", "34", True, "34"),
    ("Answer: $\\boxed{34}$", "34", True, "34"),
    ("Answer: 25", "\\boxed{25}", True, "25"),
    ("Answer: \\text{(B)}", "(B)", True, "(B)"),
    ("Answer: \\textbf{7}", "7", True, "7"),
    ("Answer: \\overline{3}", "3", True, "3"),
    # fractions and roots
    ("Answer: \\frac{1}{2}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: \\tfrac{3}{4}", "\\frac{3}{4}", True, "\\frac{3}{4}"),
    ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: \\frac 1 2", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: 1/2", "\\frac{1}{2}", False, "1/2"),
    ("Answer: 0.5", "\\frac{1}{2}", False, "0.5"),
    ("Answer: \\frac{\\sqrt{3}}{2}", "$\\frac{\\sqrt{3}}{2}$", True, "\\frac{\\sqrt{3}}{2}"),
    ("Answer: \\sqrt2", "\\sqrt{2}", True, "\\sqrt{2}"),
    ("Answer: 3 \\sqrt{2}", "3\\sqrt{2}", True, "3\\sqrt{2}"),
    # units and words
    ("Answer: 5 feet", "5", True, "5"),
    ("Answer: 5 \\text{ cm}", "5", True, "5"),
    ("Answer: 90^\\circ", "90", True, "90"),
    ("Answer: 90 degrees", "90", True, "90"),
    ("Answer: \\$25", "25", True, "25"),
    ("Answer: 25 dollars", "25", True, "25"),
    ("Answer: 5", "5 units", True, "5"),
    ("Answer: x = 12", "12", True, "12"),
    ("Answer: 10\\%", "10", False, "10\\%"),
    ("Answer: \\left(1,2\\right)", "(1,2)", False, "\\left(1,2\\right)"),
    # thousands separators and signs
    ("Answer: 1,000", "1000", True, "1000"),
    ("Answer: 1000000", "1,000,000", True, "1000000"),
    ("Answer: 1{,}000", "1000", True, "1000"),
    ("Answer: -1,000", "-1000", True, "-1000"),
    ("Answer: -7", "-7", True, "-7"),
    ("Answer: 7", "-7", False, "7"),
    ("Answer: -7", "7", False, "-7"),
    # which "Answer:" counts
    ("Answer: 3\nWait, that is wrong.\nAnswer: 4", "4", True, "4"),
    ("Answer: 3\nWait, that is wrong.\nAnswer: 4", "3", False, "4"),
    ("Answer: 3 Answer: 4", "4", False, "3Answer:4"),  # one match runs to the line end
    ("**Answer:** 42", "42", False, "**42"),
    # no usable answer
    ("The result is 5.", "5", False, "[INVALID]"),
    ("", "5", False, "[INVALID]"),
    ("Answer: $ $", "", False, ""),
    ("Answer: 5\n" + "x" * TAIL_CHARS, "5", False, "[INVALID]"),  # before the tail
    ("y" * 1000 + "Answer: 5", "5", True, "5"),
    ("Answer: 5" + "z" * (TAIL_CHARS - 5), "5", False, "[INVALID]"),  # tail cuts "Answer"
]


@pytest.mark.parametrize(("response", "ground_truth", "correct", "pred"), CASES)
def test_answer_mode(response: str, ground_truth: str, correct: bool, pred: str) -> None:
    assert compute_score(response, ground_truth) == {
        "score": 1.0 if correct else -1.0,
        "acc": correct,
        "pred": pred,
    }


@pytest.mark.parametrize(
    ("response", "ground_truth", "correct", "pred"),
    [
        ("so the total is \\boxed{34}.", "34", True, "34"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
        ("\\boxed{3} or rather \\boxed{4}", "4", True, "4"),
        ("\\boxed{ 34}", "34", False, " 34"),  # strict: no normalization
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", False, "\\dfrac{1}{2}"),
        ("\\boxed{34", "34", False, "[INVALID]"),  # braces never close
        ("Answer: 34", "34", False, "[INVALID]"),  # strict ignores Answer: lines
        ("\\boxed{34}" + " " * 100, "34", False, "[INVALID]"),  # outside the last 100 chars
    ],
)
def test_strict_box_mode(response: str, ground_truth: str, correct: bool, pred: str) -> None:
    assert compute_score(response, ground_truth, strict_box_verify=True) == {
        "score": 1.0 if correct else -1.0,
        "acc": correct,
        "pred": pred,
    }


def test_pause_tokens_index_points_into_the_full_response() -> None:
    response = "a" * 1000 + "\\boxed{7}" + "b" * 1000
    assert compute_score(response, "7", strict_box_verify=True)["acc"] is False
    scored = compute_score(response, "7", strict_box_verify=True, pause_tokens_index=[10, 20, 30, 1000])
    assert scored == {"score": 1.0, "acc": True, "pred": "7"}


def test_bad_pause_tokens_index_is_refused() -> None:
    with pytest.raises(ValueError) as excinfo:
        compute_score("\\boxed{7}", "7", strict_box_verify=True, pause_tokens_index=[1, 2])
    assert str(excinfo.value) == (
        "pause_tokens_index=[1, 2]: expected the character offsets of the 4 pause tokens as "
        "4 non-negative ints; pass None to read the response tail"
    )


def test_non_string_ground_truth_is_a_type_error() -> None:
    with pytest.raises(TypeError) as excinfo:
        compute_score("Answer: 5", 5)  # type: ignore[arg-type]
    assert str(excinfo.value) == "math_dapo: ground_truth must be a str, got int: 5"


def test_overlong_ground_truth_is_refused() -> None:
    with pytest.raises(ValueError) as excinfo:
        compute_score("Answer: 1", "1" * (MAX_GROUND_TRUTH_CHARS + 1))
    assert str(excinfo.value) == (
        f"math_dapo: ground_truth is {MAX_GROUND_TRUTH_CHARS + 1} characters, over the "
        f"{MAX_GROUND_TRUTH_CHARS}-character limit (it starts {'1' * 40!r}); the reference answer "
        "should be the short final answer, check the dataset's ground-truth column"
    )


@pytest.mark.parametrize(
    "normalized",
    [
        ("\\dfrac{3}{4}", "\\frac{3}{4}"),
        ("$1,000$ dollars", "1000"),
        ("\\text{Tuesday}", "Tuesday"),
        ("y = -2,500", "-2500"),
        ("\\boxed{5} and \\boxed{6}", "5}and\\boxed{6"),  # greedy, as in the reference
    ],
)
def test_normalize_final_answer(normalized: tuple[str, str]) -> None:
    raw, expected = normalized
    assert normalize_final_answer(raw) == expected


MILLION = 1_000_000
ADVERSARIAL_RESPONSES = {
    "one character": "x" * MILLION,
    "open braces": "{" * MILLION,
    "nested boxes": "\\boxed{" * (MILLION // 7),
    "nested boxes then answer": "\\boxed{" * (MILLION // 7) + "Answer: " + "{" * 250,
    "answer then whitespace": "Answer:" + " " * MILLION,
    "answers without colon": "answer " * (MILLION // 7),
    "answers with colon": "Answer: " * (MILLION // 8),
    "dollars": "$" * MILLION,
    "text macros": "\\text{" * (MILLION // 6),
    "frac shorthand": "Answer: " + "frac" * (MILLION // 4),
    "newlines": "\n" * MILLION,
}


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("name", sorted(ADVERSARIAL_RESPONSES))
def test_adversarial_response_is_scored_fast(name: str, strict: bool) -> None:
    response = ADVERSARIAL_RESPONSES[name]
    start = time.perf_counter()
    scored = compute_score(response, "1", strict_box_verify=strict)
    elapsed = time.perf_counter() - start
    assert scored["score"] == -1.0
    # A linear scan takes well under a second even on two loaded cores; a backtracking regex over a
    # million characters takes minutes.
    assert elapsed < 5.0, f"{name}: {elapsed:.3f} s"


ADVERSARIAL_GROUND_TRUTHS = {
    "text macros": "\\text{" * (MAX_GROUND_TRUTH_CHARS // 6),
    "nested boxes": "\\boxed{" * (MAX_GROUND_TRUTH_CHARS // 7),
    "dollars": "$" * MAX_GROUND_TRUTH_CHARS,
    "frac shorthand": "frac" * (MAX_GROUND_TRUTH_CHARS // 4),
    "articles": "a " * (MAX_GROUND_TRUTH_CHARS // 2),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL_GROUND_TRUTHS))
def test_adversarial_ground_truth_at_the_cap_is_scored_fast(name: str) -> None:
    ground_truth = ADVERSARIAL_GROUND_TRUTHS[name]
    assert len(ground_truth) <= MAX_GROUND_TRUTH_CHARS
    start = time.perf_counter()
    scored = compute_score("Answer: 1", ground_truth)
    elapsed = time.perf_counter() - start
    assert scored["acc"] is False
    assert elapsed < 5.0, f"{elapsed:.3f} s"  # as above: a backtracking match takes minutes


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.text(alphabet=st.characters(blacklist_characters=":"), max_size=2000),
    answer=st.integers(min_value=-(10**12), max_value=10**12),
)
def test_a_final_answer_line_wins_after_any_text(prefix: str, answer: int) -> None:
    response = f"{prefix}\nAnswer: {answer:,}"
    assert compute_score(response, str(answer)) == {"score": 1.0, "acc": True, "pred": str(answer)}
    assert compute_score(response, str(answer + 1))["score"] == -1.0
