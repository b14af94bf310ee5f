"""The check of the trained-sample record (megatron_dapo/collect/trained.py) against a recomputation.

Each record names a dispatched row: its group and sample, its response ids, the sample's score
and reward, the row's advantage. `check_trained_samples` recomputes each score from the response
ids with the test's reward, the shaped reward with DAPO's overlong penalty, and each advantage from
its group's recomputed rewards (mean and unbiased std, written out here rather than calling the
trainer's own function), and checks each step has whole groups of n rows of one prompt. A reward
given to another response, a sample moved into another group and a flipped sign each fail it
(tests/unit/test_trained_samples.py injects each).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (paper eq. 13)."""
    expected = max_len - buffer_len
    if length <= expected:
        return 0.0
    return max(-factor, (expected - length) / buffer_len * factor)


def check_trained_samples(records: list[dict], *, score: Callable[[list[int], str], float], n: int,
                          overlong: tuple[int, int, float] | None = None, norm_by_std: bool = True,
                          num_groups: int | None = None) -> int:
    """Raise AssertionError at the first record the recomputation disagrees with.

    Args:
        score: (response ids, ground truth) -> the test reward's score.
        n: responses per group.
        overlong: (max_response_length, buffer len, penalty factor) when shaping is on.
        num_groups: groups per step, where the run fixes it.

    Returns:
        The number of records checked.
    """
    assert records, "no trained sample was recorded"
    steps: dict[int, dict[int, list[dict]]] = {}
    for r in records:
        steps.setdefault(r["step"], {}).setdefault(r["group"], []).append(r)
    for step, groups in steps.items():
        if num_groups is not None:
            assert len(groups) == num_groups, f"step {step}: {len(groups)} groups, expected {num_groups}"
        for g, rows in groups.items():
            where = f"step {step} group {g}"
            assert sorted(r["sample"] for r in rows) == list(range(n)), f"{where}: samples {[r['sample'] for r in rows]}"
            assert all(r["prompt_ids"] == r["group_prompt_ids"] == rows[0]["group_prompt_ids"] for r in rows), \
                f"{where}: a row of another prompt"
            rewards = []
            for r in rows:
                s = score(r["response_ids"], r["ground_truth"])
                assert math.isclose(r["score"], s, abs_tol=1e-9), \
                    f"{where} sample {r['sample']}: score {r['score']} recorded, {s} from its response"
                shaped = s + (overlong_penalty(len(r["response_ids"]), *overlong) if overlong else 0.0)
                assert math.isclose(r["reward"], shaped, abs_tol=1e-6), \
                    f"{where} sample {r['sample']}: reward {r['reward']} recorded, {shaped} recomputed"
                rewards.append(shaped)
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1))
            for r, x in zip(rows, rewards):
                expected = (x - mean) / (std + 1e-6) if norm_by_std else x - mean
                assert math.isclose(r["advantage"], expected, rel_tol=1e-5, abs_tol=1e-5), \
                    f"{where} sample {r['sample']}: advantage {r['advantage']} trained, {expected} recomputed"
    return len(records)


def check_run_records(path: Path, hf_dir: Path, *, n: int, num_groups: int, max_response_length: int,
                      overlong: tuple[int, float] | None) -> int:
    """check_trained_samples over a trainer run's record (MEGATRON_DAPO_TRAINED_SAMPLES=path) with the
    reward e2e_reward_fns.char_code_score, decoded by the run's tokenizer (a checkpoint's hf/)."""
    from e2e_reward_fns import char_code_score

    from megatron_dapo.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(hf_dir))
    return check_trained_samples(
        read_records(path), score=lambda ids, gt: char_code_score(tokenizer.decode(ids), gt)["score"], n=n,
        overlong=None if overlong is None else (max_response_length, *overlong), num_groups=num_groups)
