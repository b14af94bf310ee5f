"""verl 0.9.1's own policy-loss functions (verl/trainer/ppo/core_algos.py), loaded without verl's dependencies.

scripts/install.sh installs `verl==0.9.1 --no-deps` for the tests. Importing the `verl`
package would pull in ray, tensordict, omegaconf and the rest, so this helper executes
verl's two source files that the policy losses run, core_algos.py and
utils/torch_functional.py (masked_sum / masked_mean / agg_loss's helpers), with stub
modules standing in, only while they import, for what they import at module level and
never call in a policy loss: omegaconf's DictConfig, verl's config dataclasses (AlgoConfig,
ActorConfig: the losses only read attributes of `config`), tensordict, the tokenizer type
and the device helpers. Every line of a policy loss that runs is verl's.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

VERL_VERSION = "0.9.1"


class ActorConfig:
    """Stands in for verl.workers.config.ActorConfig: the attributes the policy losses read."""

    def __init__(self, *, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
                 clip_ratio_c: float = 3.0, tau_pos: float = 1.0, tau_neg: float = 1.05,
                 policy_loss: dict[str, float] | None = None, global_batch_info: dict[str, Any] | None = None):
        self.clip_ratio = 0.2
        self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c = clip_ratio_low, clip_ratio_high, clip_ratio_c
        self.tau_pos, self.tau_neg = tau_pos, tau_neg
        knobs = dict.fromkeys(("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef"))
        self.policy_loss = types.SimpleNamespace(**{**knobs, **(policy_loss or {})})
        self.global_batch_info = global_batch_info or {}

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _exec(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_core_algos() -> types.ModuleType:
    """verl's core_algos module (its POLICY_LOSS_REGISTRY and agg_loss)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("verl")
    except PackageNotFoundError:
        found = None
    assert found == VERL_VERSION, (
        f"verl {found} is installed, the comparison needs verl=={VERL_VERSION}: run scripts/install.sh "
        f"(pip install --no-deps verl=={VERL_VERSION})")
    spec = importlib.util.find_spec("verl")  # finds the package without importing it
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))

    class _Anything:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    utils = _module("verl.utils", as_torch_index=None, group_mean_std=None)
    stubs = {
        "omegaconf": _module("omegaconf", DictConfig=_Anything),
        "tensordict": _module("tensordict", TensorDict=_Anything),
        "transformers": _module("transformers", PreTrainedTokenizer=_Anything),
        "verl": _module("verl", utils=utils),
        "verl.utils": utils,
        "verl.utils.device": _module("verl.utils.device", get_device_name=lambda: "cpu",
                                     get_torch_device=lambda: None),
        "verl.utils.import_utils": _module("verl.utils.import_utils", deprecated=lambda *_: (lambda f: f)),
        "verl.trainer": _module("verl.trainer"),
        "verl.trainer.config": _module("verl.trainer.config", AlgoConfig=type("AlgoConfig", (), {})),
        "verl.workers": _module("verl.workers"),
        "verl.workers.config": _module("verl.workers.config", ActorConfig=ActorConfig),
    }
    saved = {name: sys.modules.get(name) for name in [*stubs, "verl.utils.torch_functional", "_verl_core_algos"]}
    try:
        sys.modules.update(stubs)
        utils.torch_functional = _exec("verl.utils.torch_functional", root / "utils" / "torch_functional.py")
        return _exec("_verl_core_algos", root / "trainer" / "ppo" / "core_algos.py")
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
