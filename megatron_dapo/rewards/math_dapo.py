"""The DAPO-Math-17K verifier: +1 when the response's final answer equals the reference.

This is the reward of step 2 of the RL step (DESIGN.md). It reproduces the verifier of
the DAPO release (verl's `math_dapo.compute_score`, built on the Minerva answer
normalization of Lewkowycz et al. 2022, as in lm-eval's `minerva_math`): only the last
300 characters of a response are read, the last "Answer:" line is taken, both sides are
normalized the same way and compared as strings. There is no symbolic equivalence:
"0.5" and "\\frac{1}{2}" differ, exactly as in the paper's runs.

Model text is never evaluated as code, and every input is cut to a fixed length before
any regular expression touches it, so scoring takes bounded time whatever a policy emits.

Deliberate differences from the reference (the normalization ones only let more
spellings of the same answer match):
- "\\dfrac" and "\\tfrac" normalize to "\\frac" (the reference scores "\\dfrac{1}{2}"
  wrong against "\\frac{1}{2}").
- One trailing period is dropped ("Answer: 12." matches "12").
- Thousands separators are removed from negative integers too ("-1,000" -> "-1000").
- A response with no "Answer:" line, or whose answer normalizes to nothing, is never
  correct (the reference could match an empty or "[INVALID]" ground truth).
- `pause_tokens_index` is applied to the full response; the reference applied it after
  the 300-character cut, where such indices no longer point at the pause tokens.
"""

import re
from collections.abc import Sequence
from typing import Any

# Characters of the response tail that are read; the longest MATH-500 answer has 159.
TAIL_CHARS = 300
# Characters read before the last \boxed{} in strict mode (the reference's window).
STRICT_BOX_WINDOW_CHARS = 100
# DAPO-Math-17K answers are integers; a longer reference is a data error, not an answer.
MAX_GROUND_TRUTH_CHARS = 4096
# The prediction reported when the response has no final answer.
INVALID_PRED = "[INVALID]"

# "Answer:" in any case, then the rest of that line (the colon may be followed by
# whitespace and even a line break, as in the reference). `re.findall` semantics: the
# match that wins is the last non-overlapping one.
_ANSWER_RE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)

# Minerva's normalization tables, applied in this order by plain substring replacement.
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
_FRAC_ALIASES: tuple[tuple[str, str], ...] = (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"))

# Each pattern has one unbounded quantifier over a single character class, so matching
# is at worst quadratic in the (already capped) input: no catastrophic backtracking.
_TEXT_RE = re.compile(r"\\text\{(.*?)\}")
_TEXTBF_RE = re.compile(r"\\textbf\{(.*?)\}")
_OVERLINE_RE = re.compile(r"\\overline\{(.*?)\}")
_BOXED_GREEDY_RE = re.compile(r"\\boxed\{(.*)\}")
# TeX shorthand: \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}.
_FRAC_SHORTHAND_RE = re.compile(r"frac([^{])(.)")
_SQRT_SHORTHAND_RE = re.compile(r"sqrt([^{])")


def _first_math_span_per_line(text: str) -> str:
    """Reduce every line that holds two "$" to the first "$...$" span on it.

    Args:
        text: a partly normalized answer.

    Returns:
        `text` with each such line replaced by "$<first span>$"; other lines unchanged.
    """
    lines = text.split("\n")
    for i, line in enumerate(lines):
        start = line.find("$")
        end = line.find("$", start + 1) if start >= 0 else -1
        if end >= 0:
            lines[i] = "$" + line[start + 1 : end] + "$"
    return "\n".join(lines)


def _strip_number_commas(text: str) -> str:
    """Drop thousands separators from a (possibly negative) integer: "-12,345" -> "-12345".

    Args:
        text: a normalized answer.

    Returns:
        `text` without commas if it is an integer written with commas, else `text`.
    """
    body = text[1:] if text.startswith("-") else text
    return text.replace(",", "") if body.replace(",", "").isdigit() else text


def normalize_final_answer(final_answer: str) -> str:
    """Minerva final-answer normalization: drop units, words and TeX wrappers.

    Only the part after the last "=" is kept ("x = 5" -> "5"); spaces, "$", \\text{},
    \\textbf{}, \\overline{}, \\boxed{}, unit words ("feet", "degrees", ...), a trailing
    period and thousands separators are removed; "\\dfrac" becomes "\\frac" and TeX shorthand
    ("\\frac12") gets its braces.

    Args:
        final_answer: a short answer string (callers cap its length).

    Returns:
        The normalized answer, stripped of surrounding whitespace.
    """
    text = final_answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        text = text.replace(before, after)
    for expression in _REMOVED_EXPRESSIONS:
        text = text.replace(expression, "")
    for alias, canonical in _FRAC_ALIASES:
        text = text.replace(alias, canonical)
    text = _first_math_span_per_line(text)
    text = _TEXT_RE.sub(r"\1", text)
    text = _TEXTBF_RE.sub(r"\1", text)
    text = _OVERLINE_RE.sub(r"\1", text)
    text = _BOXED_GREEDY_RE.sub(r"\1", text)
    text = _FRAC_SHORTHAND_RE.sub(r"frac{\1}{\2}", text)
    text = _SQRT_SHORTHAND_RE.sub(r"sqrt{\1}", text)
    text = text.replace("$", "").strip().removesuffix(".")
    return _strip_number_commas(text).strip()


def last_boxed_content(text: str) -> str | None:
    """Content of the last balanced "\\boxed{...}" in `text`.

    Args:
        text: a short response window (callers cap its length; the scan is linear).

    Returns:
        The text between the braces, or None when there is no \\boxed{ or its braces
        never balance.
    """
    opening = "\\boxed{"
    start = text.rfind(opening)
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(opening) - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(opening) : i]
    return None


def _strict_box_window(solution_str: str, pause_tokens_index: Sequence[int] | None) -> str:
    """The part of the response where strict mode looks for the final \\boxed{}.

    Args:
        solution_str: the full response.
        pause_tokens_index: character offsets of the 4 pause tokens, or None.

    Returns:
        At most TAIL_CHARS characters: from 100 before the last pause token when the
        offsets are given, else the last 100 characters of the response.
    """
    if pause_tokens_index is None:
        return solution_str[-STRICT_BOX_WINDOW_CHARS:]
    if len(pause_tokens_index) != 4 or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in pause_tokens_index
    ):
        raise ValueError(
            f"pause_tokens_index={list(pause_tokens_index)!r}: expected the character offsets of "
            "the 4 pause tokens as 4 non-negative ints; pass None to read the response tail"
        )
    start = max(0, pause_tokens_index[-1] - STRICT_BOX_WINDOW_CHARS)
    return solution_str[start : start + TAIL_CHARS]


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Score one response against its reference answer, DAPO style.

    Args:
        solution_str: the decoded response (any length; only the tail is read).
        ground_truth: the reference answer, e.g. "34" (DAPO-Math-17K's
            reward_model.ground_truth).
        strict_box_verify: compare the last \\boxed{} content verbatim with the
            reference (no normalization) instead of the last "Answer:" line.
        pause_tokens_index: strict mode only: character offsets of the 4 pause tokens;
            the box is searched from 100 characters before the last one.

    Returns:
        {"score": 1.0 or -1.0, "acc": True when correct, "pred": the extracted,
        normalized prediction ("[INVALID]" when there is none)}.

    Raises:
        TypeError: an argument is not a str.
        ValueError: ground_truth is longer than MAX_GROUND_TRUTH_CHARS, or
            pause_tokens_index is not 4 non-negative ints.
    """
    for name, value in (("solution_str", solution_str), ("ground_truth", ground_truth)):
        if not isinstance(value, str):
            raise TypeError(f"math_dapo: {name} must be a str, got {type(value).__name__}: {value!r:.80}")
    if len(ground_truth) > MAX_GROUND_TRUTH_CHARS:
        raise ValueError(
            f"math_dapo: ground_truth is {len(ground_truth)} characters, over the "
            f"{MAX_GROUND_TRUTH_CHARS}-character limit (it starts {ground_truth[:40]!r}); "
            "the reference answer should be the short final answer, check the dataset's "
            "ground-truth column"
        )

    if strict_box_verify:
        boxed = last_boxed_content(_strict_box_window(solution_str, pause_tokens_index))
        pred = INVALID_PRED if boxed is None else boxed
        correct = boxed is not None and boxed == ground_truth
    else:
        matches = _ANSWER_RE.findall(solution_str[-TAIL_CHARS:])
        if matches:
            pred = normalize_final_answer(matches[-1])
            correct = pred != "" and pred == normalize_final_answer(ground_truth)
        else:
            pred, correct = INVALID_PRED, False
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
