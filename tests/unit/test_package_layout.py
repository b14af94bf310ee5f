"""The package's layout rules (DESIGN.md "Package layout"), held by reading the source.

- no import cycle between modules, lazy (function-level) imports included: a cycle that
  only works because one side imports late is still a cycle;
- the package root holds at most 16 modules; rollout/ has one folder per engine family;
- the engine is chosen only in rollout/ and config/ (no `engine == "sglang"` elsewhere);
- actor/ holds no policy-loss math: the objective lives in algo/.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_dapo"
ENGINE_FAMILIES = ("local", "sglang", "vllm")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Project modules `path` imports, at any depth; `from pkg import sub` counts as pkg.sub."""
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for a in node.names:
                if f"{target}.{a.name}" in modules:
                    out.add(f"{target}.{a.name}")
                elif target in modules:
                    out.add(target)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    # A package's __init__ re-exporting its own submodules is not a dependency between concerns.
    for name, deps in graph.items():
        if modules[name].name == "__init__.py":
            graph[name] = {d for d in deps if not d.startswith(name + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep):], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles() -> None:
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_package_root_holds_at_most_16_modules() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 16, root


def test_rollout_has_one_folder_per_engine_family() -> None:
    for family in ENGINE_FAMILIES:
        assert (PACKAGE / "rollout" / family / "__init__.py").is_file(), family
    flat = [p.name for p in (PACKAGE / "rollout").glob("*.py")]
    assert not [f for f in flat if any(f.startswith(fam) for fam in ENGINE_FAMILIES)], flat


ENGINE_SWITCH = re.compile(r"""engine\s*(==|!=|in)\s*[\(\[]?\s*["'](local|sglang|vllm)["']""")


def test_engine_is_chosen_only_in_rollout_and_config() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("rollout/", "config/")):
            continue
        offenders += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                      if ENGINE_SWITCH.search(line)]
    assert not offenders, offenders


def test_engine_switch_pattern_matches_what_it_should() -> None:
    assert ENGINE_SWITCH.search('if cfg.rollout.engine == "sglang":')
    assert ENGINE_SWITCH.search("engine in ('vllm', 'sglang')")
    assert not ENGINE_SWITCH.search("engine = build_engines(cfg)")


def test_actor_holds_no_policy_loss_math() -> None:
    offenders = []
    for path in (PACKAGE / "actor").rglob("*.py"):
        text = path.read_text()
        for word in ("clip_ratio", "clamp(ratio", "loss_agg_mode", "kl_penalty(", "aggregate_loss("):
            if word in text:
                offenders.append(f"{path.name}: {word}")
    assert not offenders, offenders


def test_engine_factory_and_config_name_the_same_engines() -> None:
    from megatron_dapo.config import ENGINE_NAMES
    from megatron_dapo.rollout.factory import FAMILIES

    assert tuple(FAMILIES) == ENGINE_NAMES
    assert all(family.name == name for name, family in FAMILIES.items())


def test_eval_takes_every_engine_the_trainer_takes() -> None:
    import argparse

    from megatron_dapo.config import ENGINE_NAMES
    from megatron_dapo.evaluate import add_eval_arguments

    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    action = next(a for a in parser._actions if a.dest == "engine")
    assert tuple(action.choices) == ENGINE_NAMES


def test_test_modules_have_unique_basenames() -> None:
    """pytest's default (prepend) import mode imports test files by basename: two test_x.py in
    different folders stop the whole run at collection ("import file mismatch")."""
    from collections import Counter

    names = Counter(p.name for p in (PACKAGE.parent / "tests").rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []


def _mode_name_uses(names: tuple[str, ...]) -> list[str]:
    """Where a policy-loss mode's name, or loss_mode itself, is written outside algo/ and config/."""
    alternatives = "|".join(map(re.escape, names))
    pattern = re.compile(rf"""["']({alternatives})["']|\bloss_mode\b""")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("algo/", "config/")):
            continue
        offenders += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    return offenders


def test_only_algo_and_config_know_the_policy_loss_modes() -> None:
    """A new objective is one function and one registry entry in algo/ (and its spec in config/):
    the actor, the trainer and the rollout never branch on a mode's name."""
    from megatron_dapo.algo.loss_modes import POLICY_LOSS_MODES

    names = tuple(m for m in POLICY_LOSS_MODES if m != "vanilla")  # "vanilla" is also an ordinary word
    assert _mode_name_uses(names) == []


def test_mode_name_pattern_matches_what_it_should(tmp_path, monkeypatch) -> None:
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "x.py").write_text('if settings.loss_mode == "gspo":\n    pass\nmode = "gspo"\n')
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert _mode_name_uses(("gspo",)) == ["actor/x.py:1", "actor/x.py:3"]
