"""The calculator tool: exact integer and decimal arithmetic of one expression, in-process.

The expression is parsed with Python's ``ast`` and only numbers, parentheses and the operators
``+ - * / // % **`` are evaluated (anything else is an error the policy sees); ``**`` is bounded
(exponent <= 64, result <= 10^300 digits' worth) and so are the operands' sizes, so no call can
take the trainer's time or memory. Integers stay exact; ``/`` gives a decimal when the division
is not exact.
"""

from __future__ import annotations

import ast
import operator
import time
from fractions import Fraction

from megatron_dapo.tools.sandbox import ToolResult

__all__ = ["MAX_DIGITS", "calculate", "format_value", "run_calculator"]

MAX_DIGITS = 300
"""Operands and results are refused past this many digits."""
MAX_EXPRESSION_CHARS = 512

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> Fraction:
    """The exact value of ``expression``; ValueError naming what is not allowed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression.strip()[:60]!r}") from None
    return _eval(tree.body)


def _check(value: Fraction) -> Fraction:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_DIGITS:
        raise ValueError(f"a number with more than {MAX_DIGITS} digits")
    return value


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(Fraction(str(node.value)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > 64:
                raise ValueError("only integer exponents up to 64")
            if abs(left) > 10**6 and right > 8:
                raise ValueError("power too large")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        return _check(Fraction(_BINARY[type(node.op)](left, right)))
    raise ValueError(f"{type(node).__name__} is not arithmetic")


def format_value(value: Fraction) -> str:
    """An integer exactly; otherwise a decimal with up to 10 places, trailing zeros dropped."""
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.10f}".rstrip("0")
    return text.rstrip(".")


def run_calculator(expression: str) -> ToolResult:
    """The calculator as a tool call: the value, or an error text (status "error")."""
    start = time.monotonic()
    try:
        text, status = format_value(calculate(expression)), "ok"
    except (ValueError, ZeroDivisionError, OverflowError) as err:
        text, status = f"error: {err}", "error"
    return ToolResult(text, status, time.monotonic() - start, "in-process")
