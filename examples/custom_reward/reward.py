"""A reward function written for verl, used by megatron-dapo as it is (examples/custom_reward/).

verl calls a custom reward as `compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=...)`; megatron-dapo sees the `data_source` parameter and calls it the same way
(megatron_dapo/rewards/registry.py). It may return a number or, as here, a dict with "score"
and extra metrics: "acc" is the accuracy dynamic sampling filters on (score > 0 when absent),
and every other number is logged per step as reward_extra/<key>/mean.

Run it (from the repository root; the module must be importable, as for verl):

    python -m megatron_dapo.train examples/custom_reward/custom_reward.yaml
    PYTHONPATH=. megatron-dapo config validate examples/custom_reward/custom_reward.yaml
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"Answer:\s*(-?\d+)\s*$")


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """+1 for the right number on the last line as "Answer: <number>", -1 otherwise.

    Args:
        data_source: the dataset row's data_source (this file's rows: "my_arithmetic").
        solution_str: the decoded response.
        ground_truth: the row's answer.
        extra_info: the row's extra_info dict, or None.

    Returns:
        {"score", "acc", "formatted"}: formatted is 1.0 when the response ends in an
        "Answer: <number>" line at all (logged as reward_extra/formatted/mean).
    """
    if data_source != "my_arithmetic":  # verl's own default_compute_score dispatches on it the same way
        raise NotImplementedError(f"no verifier for data_source={data_source!r}")
    lines = solution_str.strip().splitlines()
    match = _ANSWER.search(lines[-1]) if lines else None
    correct = match is not None and match.group(1) == str(ground_truth).strip()
    return {"score": 1.0 if correct else -1.0, "acc": correct, "formatted": 1.0 if match else 0.0}
