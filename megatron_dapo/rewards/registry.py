"""Reward functions by name: the built-in verifier or a user's "package.module:function".

The trainer's config names its reward function with one string (`reward.fn`); this
module turns that string into a callable with one contract, so the reward pool and the
trainer never care whether the function is ours or a user's:

    fn(solution_str, ground_truth, extra_info) -> {"score": float, "acc": bool, ...}

A user function is called as `f(solution_str, ground_truth, extra_info=extra_info)`,
where extra_info is the dataset row's extra_info dict (or None), and may return a number
or a dict with a "score" key. Other keys of a returned dict are kept (numeric ones are
logged per step as reward_extra/<key>/mean). A function written for verl,
`compute_score(data_source, solution_str, ground_truth, extra_info)`, is accepted as it is:
a function with a `data_source` parameter is called as verl calls it, by keyword with the
row's data_source, and verl's returns (a number, or a dict with "score" and extra metrics)
are the same as ours. User modules are imported only when asked for, so a typo fails at
start-up with a message, not mid-run.
import_user_fn is that resolution for any kind of user function: custom tools (tools/custom.py)
use it with their own contract, so both give the same one-line errors.
"""

import contextlib
import importlib
import importlib.util
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.errors import UserError
from megatron_dapo.rewards import math_dapo

RewardFn = Callable[[str, str, dict | None, str | None], dict[str, Any]]
"""fn(solution_str, ground_truth, extra_info, data_source) -> {"score", "acc", ...}."""

DEFAULT_REWARD_FN = "math_dapo"
_EXPECTED_FORM = (
    f"expected a built-in name ({DEFAULT_REWARD_FN}) or 'package.module:function' "
    "with the module importable from PYTHONPATH"
)


def _math_dapo(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict[str, Any]:
    """The DAPO verifier with the paper's settings; extra_info is not used."""
    return math_dapo.compute_score(solution_str, ground_truth)


_BUILTINS: dict[str, Callable[..., Any]] = {DEFAULT_REWARD_FN: _math_dapo}


def normalize_reward_output(output: Any, spec: str) -> dict[str, Any]:
    """Bring a reward function's return value to {"score": float, "acc": bool, ...}.

    Args:
        output: what the function returned: a real number, or a dict with "score" and
            optionally "acc" and other keys.
        spec: the function's name or spec, for error messages.

    Returns:
        A new dict with "score" as a finite float and "acc" as a bool ("score > 0"
        when the function gave no "acc"), plus the function's other keys.

    Raises:
        TypeError: the output is neither a number nor a dict with a numeric "score".
        ValueError: the score is NaN or infinite.
    """
    if isinstance(output, dict):
        if "score" not in output:
            raise TypeError(
                f"reward function {spec!r} returned a dict without 'score' (keys: {sorted(map(str, output))}); "
                "return a float or a dict with a 'score' key"
            )
        result = dict(output)
    else:
        result = {"score": output}
    score = result["score"]
    bad_score = TypeError(
        f"reward function {spec!r} returned score {score!r:.80} of type {type(score).__name__}; "
        "return a float or a dict with a 'score' key"
    )
    # Strings would convert ("1.0"), but a string score is a bug in the function.
    if isinstance(score, str | bytes):
        raise bad_score
    try:
        result["score"] = float(score)  # numpy and 0-d torch scalars convert too
    except Exception as err:
        raise bad_score from err
    if not math.isfinite(result["score"]):
        raise ValueError(f"reward function {spec!r} returned score {result['score']}; scores must be finite")
    result["acc"] = bool(result["acc"]) if "acc" in result else result["score"] > 0
    return result


def check_reward_spec(name_or_path: str) -> None:
    """What can be known of a reward spec without running the user's module (which may hang, print
    or start processes at import: that part is the probe's, in a worker, under a timeout).

    Raises:
        UserError: not a built-in and not 'module:function', or the module is not on the path.
    """
    if not isinstance(name_or_path, str):
        raise UserError(f"reward function {name_or_path!r} is a {type(name_or_path).__name__}; {_EXPECTED_FORM}")
    spec = name_or_path.strip()
    if spec in _BUILTINS:
        return
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise UserError(f"reward function {spec!r} is not a built-in and not 'module:function'; {_EXPECTED_FORM}")
    try:
        found = importlib.util.find_spec(module_name)  # imports parent packages of a dotted name, not the module
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise UserError(f"reward function {spec!r}: module {module_name!r} not found; {_EXPECTED_FORM}")


@dataclass(frozen=True, kw_only=True, slots=True)
class UserFnContract:
    """How a kind of user function is called, for the one-line errors of import_user_fn.

    Reward functions and custom tools (tools/custom.py) are both named by 'package.module:function'
    and imported in worker processes; only the words and the signature differ.
    """

    what: str
    """The function's role in messages: "reward function", "tool"."""
    expected_form: str
    """What a spec should look like, appended to errors about the spec."""
    call_form: str
    """The call the function must accept, as shown in errors: "f(solution_str, ground_truth, extra_info=...)"."""
    signature: str
    """The signature to give it: "f(solution_str, ground_truth, extra_info=None)"."""
    probe_args: tuple[Any, ...]
    """Positional arguments of a call bound (never made) to check the signature."""
    probe_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of that call."""
    alternative_kwargs: tuple[dict[str, Any], ...] = ()
    """Other calls (all by keyword) the function may accept instead: verl's compute_score."""


VERL_PARAMETER = "data_source"
"""The parameter that marks verl's signature compute_score(data_source, solution_str, ground_truth, extra_info)."""

REWARD_CONTRACT = UserFnContract(
    what="reward function", expected_form=_EXPECTED_FORM, call_form="f(solution_str, ground_truth, extra_info=...)",
    signature="f(solution_str, ground_truth, extra_info=None) or verl's compute_score(data_source, solution_str, "
              "ground_truth, extra_info)", probe_args=("", ""), probe_kwargs={"extra_info": None},
    alternative_kwargs=({VERL_PARAMETER: "", "solution_str": "", "ground_truth": "", "extra_info": None},))


def is_verl_style(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes verl's `data_source` argument (and is then called as verl calls it)."""
    try:
        return VERL_PARAMETER in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def import_user_fn(spec: str, contract: UserFnContract) -> Callable[..., Any]:
    """Resolve 'package.module:function' to the function, with user-facing errors.

    Args:
        spec: the function's spec from the config.
        contract: how the function will be called, and the words of the errors.

    Returns:
        The callable named by the spec.

    Raises:
        UserError: the spec is malformed, the module cannot be imported, the attribute
            is missing, or it is not callable as the contract calls it.
    """
    label = f"{contract.what} {spec!r}"
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise UserError(f"{label} is not a built-in and not 'module:function'; {contract.expected_form}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # A module that exists but imports a missing dependency is a different mistake.
        missing_self = err.name is not None and (
            module_name == err.name or module_name.startswith(err.name + ".")
        )
        what = (
            f"module {module_name!r} not found"
            if missing_self
            else f"importing {module_name!r} failed: {err}"
        )
        raise UserError(f"{label}: {what}; {contract.expected_form}") from err
    except (Exception, SystemExit) as err:  # a module that calls sys.exit/exit() on import, too
        raise UserError(
            f"{label}: importing {module_name!r} raised {type(err).__name__}: {err}; "
            "fix the module so that it imports cleanly"
        ) from err
    if not hasattr(module, attr):
        raise UserError(
            f"{label}: module {module_name!r} has no attribute {attr!r}; {contract.expected_form}"
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise UserError(
            f"{label}: {module_name}.{attr} is of type {type(fn).__name__}, not callable; "
            f"point the spec at a function {contract.signature}"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # builtins and C functions may have no signature; they will fail at call time
    for kwargs in contract.alternative_kwargs:
        if all(name in signature.parameters for name in kwargs):
            with contextlib.suppress(TypeError):
                signature.bind(**kwargs)
                return fn
    try:
        signature.bind(*contract.probe_args, **contract.probe_kwargs)
    except TypeError as err:
        raise UserError(
            f"{label}: cannot be called as {contract.call_form} ({err}); give it the signature {contract.signature}"
        ) from err
    return fn


def get_reward_fn(name_or_path: str) -> RewardFn:
    """The reward function named by a config string.

    Args:
        name_or_path: "math_dapo" (the DAPO verifier) or "package.module:function".

    Returns:
        fn(solution_str, ground_truth, extra_info, data_source=None) -> dict with at least
        "score" (float) and "acc" (bool). A verl-style function (is_verl_style) gets all four
        by keyword. It is a closure: send the spec, not the function, to other processes.

    Raises:
        UserError (a ValueError): the spec names nothing usable; the message says why.
    """
    if not isinstance(name_or_path, str):
        raise UserError(
            f"reward function {name_or_path!r} is a {type(name_or_path).__name__}; {_EXPECTED_FORM}"
        )
    spec = name_or_path.strip()
    fn = _BUILTINS[spec] if spec in _BUILTINS else import_user_fn(spec, REWARD_CONTRACT)

    if spec not in _BUILTINS and is_verl_style(fn):
        def call(solution_str: str, ground_truth: str, extra_info: dict | None,
                 data_source: str | None = None) -> dict[str, Any]:
            return normalize_reward_output(fn(data_source=data_source, solution_str=solution_str,
                                              ground_truth=ground_truth, extra_info=extra_info), spec)

        return call

    def call_ours(solution_str: str, ground_truth: str, extra_info: dict | None,
                  data_source: str | None = None) -> dict[str, Any]:
        return normalize_reward_output(fn(solution_str, ground_truth, extra_info=extra_info), spec)

    return call_ours
