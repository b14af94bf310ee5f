"""The reward pool: failures are counted and scored -1, hung workers are replaced,
results keep input order, huge responses are cut, bad setups fail at construction."""

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import reward_fns_for_tests

from megatron_dapo.errors import UserError
from megatron_dapo.rewards.pool import FAILURE_SCORE, RewardFunctionBroken, RewardPool, RewardStats

HELPERS = reward_fns_for_tests.__name__
TIMEOUT_S = 3.0  # every 'ok' call must answer within it, also on a loaded CI machine


@pytest.fixture(scope="module")
def misbehave_pool() -> Iterator[RewardPool]:
    """Two workers of `misbehave`, shared by the tests that break them (starting is the slow part)."""
    with RewardPool(f"{HELPERS}:misbehave", num_workers=2, timeout_s=TIMEOUT_S) as pool:
        yield pool


def test_raise_and_hang_are_counted_and_the_pool_keeps_working(
    misbehave_pool: RewardPool, caplog: pytest.LogCaptureFixture
) -> None:
    batch = [("ok", "", None), ("raise", "", None), ("hang", "", None), ("ok", "", None)]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.rewards.pool"):
        results, stats = misbehave_pool.score_batch(batch)
    elapsed = time.monotonic() - start

    assert results == [
        {"score": 1.0, "acc": True},
        {"score": FAILURE_SCORE, "acc": False, "error": "RuntimeError: cannot score 'raise'"},
        {"score": FAILURE_SCORE, "acc": False, "error": f"timeout after {TIMEOUT_S} s"},
        {"score": 1.0, "acc": True},
    ]
    assert stats == RewardStats(
        num_calls=4,
        num_errors=1,
        num_timeouts=1,
        num_truncated=0,
        first_error="RuntimeError: cannot score 'raise'",
    )
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 5.0
    assert [record.getMessage() for record in caplog.records] == [
        f"reward '{HELPERS}:misbehave': 2 of 4 calls failed (1 errors, 1 timeouts of {TIMEOUT_S} s), "
        "scored -1.0; first: RuntimeError: cannot score 'raise'"
    ]

    # The hung worker was replaced: the next batch is scored in full, with no warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.rewards.pool"):
        results, stats = misbehave_pool.score_batch([("ok", "", None)] * 5)
    assert [result["score"] for result in results] == [1.0] * 5
    assert (stats.num_errors, stats.num_timeouts, stats.first_error) == (0, 0, None)
    assert caplog.records == []


def test_a_worker_that_dies_is_an_error_and_is_replaced(misbehave_pool: RewardPool) -> None:
    results, stats = misbehave_pool.score_batch([("die", "", None), ("ok", "", None), ("die", "", None)])
    assert results == [
        {"score": FAILURE_SCORE, "acc": False, "error": "worker process died (exit code 3)"},
        {"score": 1.0, "acc": True},
        {"score": FAILURE_SCORE, "acc": False, "error": "worker process died (exit code 3)"},
    ]
    assert (stats.num_errors, stats.num_timeouts) == (2, 0)
    results, _ = misbehave_pool.score_batch([("ok", "", None)] * 3)
    assert [result["score"] for result in results] == [1.0] * 3


def test_results_keep_input_order_under_concurrency() -> None:
    # Earlier calls sleep longer, so they finish last: order must come from the indices.
    sleeps = [0.05 * (12 - i) for i in range(12)]
    batch = [(f"response {i}", str(i), {"sleep_s": sleep_s}) for i, sleep_s in enumerate(sleeps)]
    with RewardPool(f"{HELPERS}:echo", num_workers=3, timeout_s=5.0) as pool:
        start = time.monotonic()
        results, stats = pool.score_batch(batch)
        elapsed = time.monotonic() - start
    assert [result["score"] for result in results] == [float(i) for i in range(12)]
    assert [result["response"] for result in results] == [f"response {i}" for i in range(12)]
    assert len({result["pid"] for result in results}) == 3
    assert stats == RewardStats(num_calls=12, num_errors=0, num_timeouts=0, num_truncated=0, first_error=None)
    assert elapsed < 0.75 * sum(sleeps)  # 3.9 s of sleeping, about 1.3 s when spread over 3 workers


def test_math_dapo_in_workers_and_long_responses_keep_their_tail() -> None:
    long_response = "x" * 50 + "\nAnswer: 7"
    with RewardPool("math_dapo", num_workers=1, timeout_s=5.0, max_response_chars=20) as pool:
        results, stats = pool.score_batch([(long_response, "7", None), ("Answer: 8", "7", None)])
    assert results == [{"score": 1.0, "acc": True, "pred": "7"}, {"score": -1.0, "acc": False, "pred": "8"}]
    assert stats.num_truncated == 1


def test_in_process_scoring_counts_errors_and_warns_that_timeouts_are_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.rewards.pool"):
        pool = RewardPool(f"{HELPERS}:echo", num_workers=0, timeout_s=2.0, max_response_chars=4)
        results, stats = pool.score_batch([("abcdef", "1", None), ("ab", "not a number", None)])
    assert results == [
        {"score": 1.0, "acc": True, "response": "cdef", "pid": results[0]["pid"]},
        {
            "score": FAILURE_SCORE,
            "acc": False,
            "error": "ValueError: could not convert string to float: 'not a number'",
        },
    ]
    assert stats == RewardStats(
        num_calls=2,
        num_errors=1,
        num_timeouts=0,
        num_truncated=1,
        first_error="ValueError: could not convert string to float: 'not a number'",
    )
    assert caplog.records[0].getMessage() == (
        f"RewardPool('{HELPERS}:echo') with num_workers=0 scores in-process: timeout_s=2.0 is not enforced"
    )
    pool.close()
    with pytest.raises(RuntimeError) as excinfo:
        pool.score_batch([])
    assert str(excinfo.value) == f"RewardPool('{HELPERS}:echo') is closed; create a new pool to score more"


def test_bad_spec_fails_at_construction() -> None:
    with pytest.raises(UserError) as excinfo:
        RewardPool("no_such_reward_module:score", num_workers=2, timeout_s=1.0)
    assert str(excinfo.value).startswith("reward function 'no_such_reward_module:score': module ")


def test_spec_that_only_the_parent_can_import_fails_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "reward_parent_only.py").write_text(
        "import multiprocessing\n"
        "if multiprocessing.parent_process() is not None:\n"
        "    raise ImportError('not in workers')\n"
        "def score(solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as excinfo:
        RewardPool("reward_parent_only:score", num_workers=1, timeout_s=1.0)
    assert str(excinfo.value) == (
        "reward function 'reward_parent_only:score': importing 'reward_parent_only' raised ImportError: "
        "not in workers; fix the module so that it imports cleanly (in a worker process: the module must be "
        "importable by name from a fresh interpreter, not __main__)"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": -1}, "RewardPool num_workers=-1: expected an int >= 0 (0 scores in-process)"),
        ({"timeout_s": 0}, "RewardPool timeout_s=0: expected a finite number of seconds > 0"),
        ({"timeout_s": float("inf")}, "RewardPool timeout_s=inf: expected a finite number of seconds > 0"),
        ({"max_response_chars": 0}, "RewardPool max_response_chars=0: expected an int >= 1"),
        (
            {"start_method": "fork"},
            "RewardPool start_method='fork': expected one of ['forkserver', 'spawn'] "
            "(fork is unsafe beside torch threads)",
        ),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict, message: str) -> None:
    arguments = {"fn_spec": "math_dapo", "num_workers": 0, "timeout_s": 1.0} | kwargs
    with pytest.raises(UserError) as excinfo:
        RewardPool(**arguments)
    assert str(excinfo.value) == message


def test_a_reward_that_mostly_fails_stops_with_its_own_error() -> None:
    # Before: every call scored -1 and the run trained on (or, with DAPO, filtered away) a constant.
    inputs = [("raise", "1", None)] * 17 + [("ok", "1", None)] * 3
    with RewardPool("reward_fns_for_tests:misbehave", num_workers=0, timeout_s=1.0,
                    max_failure_fraction=0.5) as pool, pytest.raises(RewardFunctionBroken) as info:
        pool.score_batch(inputs)
    assert str(info.value) == (
        "reward function 'reward_fns_for_tests:misbehave' failed on 16 of 16 calls (16 errors, 0 timeouts of "
        "1 s), more than reward.max_failure_fraction=0.5; first: RuntimeError: cannot score 'raise'. Fix the "
        "reward function (or raise reward.timeout_s if it is only slow)")


def test_a_hung_reward_trips_the_breaker_after_a_small_batch_not_every_call() -> None:
    inputs = [("hang", "1", None)] * 4
    start = time.monotonic()
    with RewardPool("reward_fns_for_tests:misbehave", num_workers=2, timeout_s=0.3,
                    max_failure_fraction=0.5) as pool, pytest.raises(RewardFunctionBroken, match=r"failed on \d of \d "
                                                                     r"calls \(0 errors, \d timeouts of 0.3 s\)"):
        pool.score_batch(inputs)
    assert time.monotonic() - start < 60


def test_a_few_failures_under_the_share_do_not_stop_the_run() -> None:
    inputs = [("raise", "1", None)] * 8 + [("ok", "1", None)] * 12
    with RewardPool("reward_fns_for_tests:misbehave", num_workers=0, timeout_s=1.0,
                    max_failure_fraction=0.5) as pool:
        results, stats = pool.score_batch(inputs)
    assert stats.num_errors == 8 and [r["score"] for r in results[8:]] == [1.0] * 12


def test_data_source_reaches_a_verl_function_in_the_workers() -> None:
    with RewardPool(f"{HELPERS}:verl_compute_score", num_workers=2, timeout_s=5.0) as pool:
        results, stats = pool.score_batch([("4", "4", None, "gsm8k"), ("3", "4", {"a": 1}, "aime"), ("4", "4", None)])
    assert stats.num_errors == 1 and "no data_source" in (stats.first_error or "")  # a 3-tuple has none
    assert [r.get("source") for r in results[:2]] == ["gsm8k", "aime"]
    assert [r["score"] for r in results] == [1.0, -1.0, FAILURE_SCORE]
    assert results[1]["has_extra_info"] is True
