"""Reward functions for the reward registry and pool tests.

They live in an importable module, not in the test files, because pool workers are
fresh interpreters that import a reward function by its "module:function" spec.
"""

import os
import time
from typing import Any


def half(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Always 0.5: a float return value."""
    return 0.5


def negative_quarter(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Always -0.25: a float return value whose acc must come out False."""
    return -0.25


def integer_one(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> int:
    """Always the int 1, which must become the float 1.0."""
    return 1


def zero_but_accurate(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """A dict whose own acc and extra key must be kept."""
    return {"score": 0.0, "acc": True, "source": "custom"}


def string_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> str:
    """An invalid return value: a string."""
    return "1.0"


def dict_without_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """An invalid return value: a dict without "score"."""
    return {"reward": 1.0}


def nan_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """An invalid return value: NaN."""
    return float("nan")


def echo_extra_info(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """Returns extra_info, to show that it arrives as given."""
    return {"score": 1.0, "extra_info": extra_info}


def two_arguments(solution_str: str, ground_truth: str) -> float:
    """Cannot take extra_info: the registry must refuse it."""
    return 1.0


NOT_CALLABLE = 42


def echo(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict[str, Any]:
    """Score float(ground_truth) after sleeping extra_info["sleep_s"]; echo the response.

    The sleep lets calls finish out of order, to check that results keep input order.
    """
    if extra_info is not None:
        time.sleep(extra_info.get("sleep_s", 0.0))
    return {"score": float(ground_truth), "acc": True, "response": solution_str, "pid": os.getpid()}


def misbehave(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0, except: "raise" raises, "hang" sleeps an hour, "die" ends the process."""
    if solution_str == "raise":
        raise RuntimeError(f"cannot score {solution_str!r}")
    if solution_str == "hang":
        time.sleep(3600.0)
    if solution_str == "die":
        os._exit(3)
    return 1.0


def verl_compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """verl's signature and return: a dict with "score" and extra metrics (no "acc")."""
    if data_source is None:
        raise ValueError("no data_source")
    return {"score": 1.0 if solution_str == ground_truth else -1.0, "source": data_source,
            "source_length": len(data_source), "has_extra_info": extra_info is not None}


def verl_float(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None) -> float:
    """verl's signature, returning a bare number."""
    return 0.5 if data_source == "gsm8k" else -0.5
