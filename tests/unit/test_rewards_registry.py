"""Reward functions by name: built-in, user specs, output normalization, spec errors."""

import math
import sys
from pathlib import Path

import pytest
import reward_fns_for_tests

from megatron_dapo.errors import UserError
from megatron_dapo.rewards.registry import DEFAULT_REWARD_FN, get_reward_fn, normalize_reward_output

HELPERS = reward_fns_for_tests.__name__
EXPECTED_FORM = "expected a built-in name (math_dapo) or 'package.module:function' with the module importable from PYTHONPATH"


def test_math_dapo_is_the_default_and_scores() -> None:
    fn = get_reward_fn(DEFAULT_REWARD_FN)
    assert DEFAULT_REWARD_FN == "math_dapo"
    assert fn("Answer: 5", "5", None) == {"score": 1.0, "acc": True, "pred": "5"}
    assert fn("Answer: 4", "5", {"index": 3}) == {"score": -1.0, "acc": False, "pred": "4"}


@pytest.mark.parametrize(
    ("function", "expected"),
    [
        ("half", {"score": 0.5, "acc": True}),
        ("negative_quarter", {"score": -0.25, "acc": False}),
        ("zero_but_accurate", {"score": 0.0, "acc": True, "source": "custom"}),
    ],
)
def test_user_function_output_is_normalized(function: str, expected: dict) -> None:
    assert get_reward_fn(f"{HELPERS}:{function}")("Answer: 1", "1", None) == expected


def test_integer_score_becomes_float() -> None:
    score = get_reward_fn(f"{HELPERS}:integer_one")("", "", None)["score"]
    assert type(score) is float and score == 1.0


def test_extra_info_reaches_the_user_function() -> None:
    result = get_reward_fn(f"{HELPERS}:echo_extra_info")("", "", {"split": "train", "index": 7})
    assert result == {"score": 1.0, "acc": True, "extra_info": {"split": "train", "index": 7}}


def test_string_score_is_a_type_error() -> None:
    spec = f"{HELPERS}:string_score"
    with pytest.raises(TypeError) as excinfo:
        get_reward_fn(spec)("", "", None)
    assert str(excinfo.value) == (
        f"reward function {spec!r} returned score '1.0' of type str; return a float or a dict with a 'score' key"
    )


def test_dict_without_score_is_a_type_error() -> None:
    spec = f"{HELPERS}:dict_without_score"
    with pytest.raises(TypeError) as excinfo:
        get_reward_fn(spec)("", "", None)
    assert str(excinfo.value) == (
        f"reward function {spec!r} returned a dict without 'score' (keys: ['reward']); "
        "return a float or a dict with a 'score' key"
    )


def test_nan_score_is_refused() -> None:
    with pytest.raises(ValueError) as excinfo:
        get_reward_fn(f"{HELPERS}:nan_score")("", "", None)
    assert (
        str(excinfo.value)
        == f"reward function '{HELPERS}:nan_score' returned score nan; scores must be finite"
    )


def test_normalize_keeps_given_acc_and_converts_numpy_like_scores() -> None:
    class Scalar:
        def __float__(self) -> float:
            return 0.75

    assert normalize_reward_output({"score": Scalar(), "acc": 0}, "x") == {"score": 0.75, "acc": False}
    assert math.copysign(1.0, normalize_reward_output(-0.0, "x")["score"]) == -1.0


def test_unknown_name_says_the_expected_form() -> None:
    with pytest.raises(UserError) as excinfo:
        get_reward_fn("math_dap")
    assert (
        str(excinfo.value)
        == f"reward function 'math_dap' is not a built-in and not 'module:function'; {EXPECTED_FORM}"
    )


def test_missing_module() -> None:
    with pytest.raises(ValueError) as excinfo:
        get_reward_fn("no_such_reward_module:score")
    assert str(excinfo.value) == (
        f"reward function 'no_such_reward_module:score': module 'no_such_reward_module' not found; {EXPECTED_FORM}"
    )


def test_missing_attribute() -> None:
    with pytest.raises(ValueError) as excinfo:
        get_reward_fn(f"{HELPERS}:no_such_function")
    assert str(excinfo.value) == (
        f"reward function '{HELPERS}:no_such_function': module '{HELPERS}' has no attribute "
        f"'no_such_function'; {EXPECTED_FORM}"
    )


def test_not_callable() -> None:
    with pytest.raises(ValueError) as excinfo:
        get_reward_fn(f"{HELPERS}:NOT_CALLABLE")
    assert str(excinfo.value) == (
        f"reward function '{HELPERS}:NOT_CALLABLE': {HELPERS}.NOT_CALLABLE is of type int, not callable; "
        "point the spec at a function f(solution_str, ground_truth, extra_info=None) or verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info)"
    )


def test_function_without_extra_info_parameter() -> None:
    with pytest.raises(ValueError) as excinfo:
        get_reward_fn(f"{HELPERS}:two_arguments")
    assert str(excinfo.value) == (
        f"reward function '{HELPERS}:two_arguments': cannot be called as "
        "f(solution_str, ground_truth, extra_info=...) (got an unexpected keyword argument 'extra_info'); "
        "give it the signature f(solution_str, ground_truth, extra_info=None) or verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info)"
    )


def test_module_with_a_missing_dependency_is_not_reported_as_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "reward_needing_dep.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "reward_needing_dep", raising=False)
    with pytest.raises(ValueError) as excinfo:
        get_reward_fn("reward_needing_dep:score")
    assert str(excinfo.value) == (
        "reward function 'reward_needing_dep:score': importing 'reward_needing_dep' failed: "
        f"No module named 'no_such_dependency_xyz'; {EXPECTED_FORM}"
    )


def test_module_that_raises_on_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "reward_broken.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as excinfo:
        get_reward_fn("reward_broken:score")
    assert str(excinfo.value) == (
        "reward function 'reward_broken:score': importing 'reward_broken' raised RuntimeError: boom; "
        "fix the module so that it imports cleanly"
    )


def test_a_verl_compute_score_is_called_as_verl_calls_it() -> None:
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info) plugs in as it is (issue 60)."""
    fn = get_reward_fn(f"{HELPERS}:verl_compute_score")
    assert fn("4", "4", {"k": 1}, "openai/gsm8k") == {
        "score": 1.0, "acc": True, "source": "openai/gsm8k", "source_length": 12, "has_extra_info": True}
    assert fn("5", "4", None, "aime")["acc"] is False
    verl_float = get_reward_fn(f"{HELPERS}:verl_float")
    assert verl_float("x", "y", None, "gsm8k") == {"score": 0.5, "acc": True}
    assert verl_float("x", "y", None, "math") == {"score": -0.5, "acc": False}
    # Ours is still called positionally, without data_source.
    assert get_reward_fn(f"{HELPERS}:half")("x", "y", None, "gsm8k") == {"score": 0.5, "acc": True}


def test_a_verl_function_missing_an_argument_names_both_signatures(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rw_verl_partial.py").write_text("def compute_score(data_source, solution_str):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"give it the signature f\(solution_str, ground_truth, extra_info=None\) "
                                        r"or verl's compute_score\(data_source, solution_str, ground_truth, "
                                        r"extra_info\)$"):
        get_reward_fn("rw_verl_partial:compute_score")


def test_the_docs_quote_the_signatures_the_registry_accepts() -> None:
    from megatron_dapo.rewards.registry import REWARD_CONTRACT

    ours, verl = REWARD_CONTRACT.signature.split(" or verl's ")
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "data-and-reward.md").read_text()
    assert verl == "compute_score(data_source, solution_str, ground_truth, extra_info)"
    assert verl in guide and ours in guide
