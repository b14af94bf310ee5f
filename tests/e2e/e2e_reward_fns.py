"""Reward functions for the end-to-end tests, importable by reward-pool workers (PYTHONPATH)."""


def char_parity(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """+1 when the response's character codes sum to an even number: spread in every group.

    A random-init tiny model never answers correctly, so the math verifier would make every
    group all-wrong; this reward keeps dynamic sampling busy without a trained policy.
    """
    acc = sum(map(ord, solution_str)) % 2 == 0
    return {"score": 1.0 if acc else -1.0, "acc": acc}


def always_fails(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """A broken reward function: the run must stop with this error, not train on -1."""
    raise ZeroDivisionError("the grader divided by zero")


def even_answer(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """+1 when the problem's answer is even, whatever the response: an accuracy that depends on the
    prompts alone, the same on every machine and for every model (the warm start's band tests)."""
    acc = int(ground_truth) % 2 == 0
    return {"score": 1.0 if acc else -1.0, "acc": acc}


def digit_share(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """2 x (share of the response's visible characters that are digits) - 1: a reward a policy
    learns in a few steps by moving probability onto digit tokens, whatever it knows of arithmetic
    (the learning check, tests/e2e/test_learning.py). acc = at least half digits."""
    visible = [c for c in solution_str if not c.isspace()]
    share = sum(c.isdigit() for c in visible) / len(visible) if visible else 0.0
    return {"score": 2.0 * share - 1.0, "acc": share >= 0.5}


def char_code_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """char_parity's acc (so dynamic sampling keeps the same groups) with a score of seven levels,
    ((sum of character codes) mod 7 - 3) / 3: a known function of each response that differs
    between the responses of a group, so a reward moved to another response shows
    (tests/trained_samples.py)."""
    total = sum(map(ord, solution_str))
    return {"score": (total % 7 - 3) / 3, "acc": total % 2 == 0}
