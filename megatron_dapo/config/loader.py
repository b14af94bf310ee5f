"""YAML <-> Config: strict loading with dotted command-line overrides, and the way back.

The section modules hold the typed dataclasses and their validation; this module only reads and
writes them. Loading is strict: an unknown key, a wrong type or an inconsistent value
fails with one line naming the key, where it came from (the file or the command line)
and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_dapo.config.experiment import Config
from megatron_dapo.config.fields import ConfigError, _FieldError, show
from megatron_dapo.config.verl_names import verl_hint


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads 1e-6 as a float (YAML 1.1 wants 1.0e-6; every user writes 1e-6)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def _no_duplicate_keys(loader: _YamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    """A mapping whose keys are unique: PyYAML keeps the last of two equal keys without a word,
    so a second `optim:` section silently replaced the first one's values. Merge keys (`<<: *base`)
    are YAML's own way to reuse a section: the mapping's own keys override what they merge."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if not isinstance(key, str | int | float | bool | None):
            continue  # SafeLoader reports unhashable keys itself
        if key in seen:
            raise _DuplicateKey(f"line {line}: duplicate key {key!r} (first at line {seen[key]}); "
                                "merge the two into one")
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


class _DuplicateKey(yaml.YAMLError):
    pass


_YamlLoader.construct_mapping = _no_duplicate_keys  # type: ignore[method-assign]


MAX_CONFIG_BYTES = 1 << 20
"""A config (or one override) is a few KB; 1 MiB is far past any real one and still parses in well
under a second (a 50 MB file took minutes, all of it in PyYAML)."""
MAX_VALUES = 100_000
"""Values in the loaded tree, each alias counted every time it is used: an alias "bomb" is a few
lines that expand to billions (PyYAML shares the objects, but anything that walks them does not)."""
MAX_DEPTH = 64
"""Nesting depth; a config is 3-4 deep, and PyYAML's composer recurses once per level."""
MAX_EXPANDED_CHARS = 8 * MAX_CONFIG_BYTES
"""Characters of the strings in the loaded tree, each alias counted every time it is used: 99,000
uses of one 600 KB string pass MAX_VALUES and expand to 59 GB in anything that prints them
(`config show`, an error message); a config without aliases has at most MAX_CONFIG_BYTES."""


class _TooLarge(yaml.YAMLError):
    pass


def _yaml_load(text: str) -> Any:
    """yaml.load with bounds: bytes, nesting, expanded size; each excess is a _TooLarge or YAMLError."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONFIG_BYTES:
        raise _TooLarge(f"{size / 2**20:.1f} MiB of YAML, more than the {MAX_CONFIG_BYTES >> 20} MiB a config may "
                        "have (a real one is a few KB); check that this is the config file you meant")
    try:
        data = yaml.load(text, Loader=_YamlLoader)  # a SafeLoader subclass: no arbitrary objects
    except RecursionError:
        raise _TooLarge(f"nested deeper than the {MAX_DEPTH} levels a config may have") from None
    except ValueError as e:  # int('5000 digits') past Python's limit, and the like
        if "integer string conversion" in str(e):
            raise _TooLarge(f"an integer of more than {sys.get_int_max_str_digits()} digits; no setting takes one "
                            "that large: write the number you meant") from None
        raise _TooLarge(f"a value YAML cannot read ({str(e).splitlines()[0][:120]}); write it as a plain "
                        "number or string") from None
    _check_size(data)
    return data


def _check_size(data: Any) -> None:
    """Walk the loaded tree, aliases expanded, and stop at MAX_VALUES values, MAX_EXPANDED_CHARS
    characters of strings or MAX_DEPTH levels."""
    count = chars = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise _TooLarge(f"the YAML expands to more than {MAX_VALUES:,} values (an alias used inside "
                            "another alias, again and again?); write the values out")
        if isinstance(node, str | bytes):
            chars += len(node)
            if chars > MAX_EXPANDED_CHARS:
                raise _TooLarge(f"the YAML expands to more than {MAX_EXPANDED_CHARS >> 20} MiB of strings (a long "
                                "string used again and again through an alias?); write the values out")
        if depth > MAX_DEPTH:
            raise _TooLarge(f"nested deeper than the {MAX_DEPTH} levels a config may have")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


# ------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        others = [arg for arg in typing.get_args(tp) if arg is not type(None)]
        if value is not None and len(others) == 1:
            return _coerce(value, others[0], key)  # X | null: X's own message (choices, finite, ...)
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except _FieldError:
                continue
        raise _FieldError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {show(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and ("off" if value is False else "on") in choices:
            value = "off" if value is False else "on"  # YAML 1.1 reads a bare off/on as a boolean
        if value not in choices:
            hint = difflib.get_close_matches(show(value), [str(c) for c in choices], n=1)
            extra = f"; did you mean {hint[0]!r}?" if hint else ""
            raise _FieldError(key, f"must be one of {', '.join(map(repr, choices))}, got {show(value)}{extra}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise _FieldError(key, f"expected a list, got {type(value).__name__} {show(value)}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, key) for v in value]
    if tp is type(None):
        if value is not None:
            raise _FieldError(key, f"expected null, got {show(value)}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise _FieldError(key, f"expected true or false, got {type(value).__name__} {show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _FieldError(key, f"expected an integer, got {type(value).__name__} {show(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _FieldError(key, f"expected a number, got {type(value).__name__} {show(value)}")
        if not math.isfinite(value):
            raise _FieldError(key, f"expected a finite number, got {show(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _FieldError(key, f"expected a string, got {type(value).__name__} {show(value)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _FieldError(key, f"expected a mapping of {tp.__name__} fields, got {show(value)}")
        return _build(tp, value, key + ".")
    raise TypeError(f"unsupported annotation {tp!r} for {key}")  # a bug in this module, not user input


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise _FieldError(f"{prefix}{show(key) if not isinstance(key, str) else key[:80]}",
                              f"unknown key; {_unknown_key_fix(prefix, key, data[key], names)}")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except _FieldError as e:
        raise _FieldError(prefix + e.key, e.message) from None


def _unknown_key_fix(prefix: str, key: Any, value: Any, names: list[str]) -> str:
    """What to write instead of an unknown key: verl's name for one of ours (verl_names.py), a
    close spelling in the same section, the same key in another section, or the valid keys."""
    verl = verl_hint(prefix + key, value) if isinstance(key, str) else None
    if verl is not None:
        return verl
    hint = difflib.get_close_matches(show(key), names, n=1, cutoff=0.5)
    if hint:
        return f"did you mean '{prefix}{hint[0]}'?"
    elsewhere = [path for path in _config_keys() if path.rpartition(".")[2] == key]
    if len(elsewhere) == 1:
        return f"did you mean '{elsewhere[0]}'?"
    return f"valid keys: {', '.join(names)}"


def _config_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the config, sections' own keys included."""
    out = []
    for f in dataclasses.fields(cls):
        out.append(prefix + f.name)
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(_config_keys(tp, f"{prefix}{f.name}."))
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse a dotted command-line override `a.b.c=value` (value in YAML syntax)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"command line: bad override {show(text)}; expected dotted.key=value, e.g. "
                          "algorithm.clip_ratio_high=0.28")
    try:
        value = _yaml_load(raw) if raw != "" else ""
    except _TooLarge as e:
        raise ConfigError(f"command line: the value of {key[:80]!r}: {e}") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"command line: cannot parse the value of {key!r}: {problem}") from None
    return key.split("."), value


def _set_dotted(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """Set one override; a mapping value merges into the section it names (`optim={lr: 1e-4}`
    changes lr and keeps the file's other optim keys), any other value replaces."""
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"command line: cannot set {'.'.join(path)}: {part} is a value, not a section")
        node = child
    old = node.get(path[-1])
    if isinstance(value, dict) and isinstance(old, dict):
        for key, sub in value.items():
            _set_dotted(old, [key], sub)
        return
    node[path[-1]] = value


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML experiment file, apply dotted overrides, validate everything.

    Args:
        path: the YAML file; None = all defaults.
        overrides: `dotted.key=value` strings, applied in order after the file.

    Returns:
        The validated Config.

    Raises:
        ConfigError: one line naming the key, its source (file or command line) and the fix.
    """
    source = str(path) if path is not None else "defaults"
    tree: dict[str, Any] = {}
    if path is not None:
        tree = read_config_tree(path)
    overridden: set[str] = set()
    for text in overrides:
        keys, value = parse_override(text)
        _set_dotted(tree, keys, value)
        overridden.add(".".join(keys))
    try:
        return _build(Config, tree, "")
    except _FieldError as e:
        if any(_related(e.key, k) for k in overridden):
            raise ConfigError(f"command line: {_describe(tree, e)}") from None
        # A rule between two keys names the one it is attached to; when the command line changed
        # the other one, that change is what the user just did: name it first.
        changed = [k for k in sorted(overridden) if _mentioned(k, e)]
        if changed and path is not None:
            value = _lookup(tree, changed[0])
            raise ConfigError(f"command line: {changed[0]}={show(value)} conflicts with {source}: "
                              f"{_describe(tree, e)}") from None
        raise ConfigError(f"{source}: {_describe(tree, e)}") from None


def read_config_tree(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's YAML as a mapping of sections, read with the loader's bounds.

    Raises:
        ConfigError: missing, too large, not UTF-8, not YAML, too deep or too large once expanded,
            empty or not a mapping; one line naming the file.
    """
    source = str(path)
    p = Path(path)
    try:
        if not p.is_file():
            raise ConfigError(f"{source}: no such config file; pick one of examples/*.yaml")
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{source}: {size / 2**20:.1f} MiB, more than the {MAX_CONFIG_BYTES >> 20} MiB a config may "
                              "have (a real one is a few KB); check that this is the config file you meant")
        raw = p.read_bytes()
    except OSError as e:  # a name too long, a directory not readable
        raise ConfigError(f"{show(source)}: cannot read the config file ({e.strerror or e}); give a path to a "
                          "readable YAML file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{source} line {line}: not UTF-8 (byte {raw[e.start]:#04x}); "
                          "save the file as UTF-8") from None
    try:
        loaded = _yaml_load(text)
    except _DuplicateKey as e:
        raise ConfigError(f"{source} {e}") from None
    except _TooLarge as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{where}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if loaded is None:
        raise ConfigError(f"{source}: the file is empty (or only comments); start from examples/tiny_cpu.yaml "
                          "or examples/dapo_qwen2.5_32b.yaml")
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections (model, data, ...)")
    return loaded


def _mentioned(key: str, err: _FieldError) -> bool:
    """Whether the rule that failed names `key` (dotted, or its last part inside the same section)."""
    if re.search(rf"\b{re.escape(key)}\b", err.message):
        return True
    section, _, name = key.rpartition(".")
    same_section = err.key.rpartition(".")[0] == section
    return same_section and re.search(rf"(?<![\w.]){re.escape(name)}\b", err.message) is not None


_MISSING = object()


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _describe(tree: dict[str, Any], err: _FieldError) -> str:
    """`key=value: problem`, or `key=value problem` when the message starts with the value."""
    if err.message.startswith("="):
        return f"{err.key}{err.message}"
    value = _lookup(tree, err.key)
    shown = f"={show(value)}" if value is not _MISSING and not err.message.startswith("unknown key") else ""
    return f"{err.key}{shown}: {err.message}"


def _lookup(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain containers (what `config show` prints and checkpoints store)."""
    return {f.name: (to_dict(v) if dataclasses.is_dataclass(v := getattr(cfg, f.name)) else v)
            for f in dataclasses.fields(cfg)}


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML that load_config reads back to an equal Config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def from_dict(data: dict[str, Any], source: str = "checkpoint") -> Config:
    """Rebuild a Config from to_dict output (e.g. a checkpoint's stored config)."""
    try:
        return _build(Config, data, "")
    except _FieldError as e:
        raise ConfigError(f"{source}: {_describe(data, e)}") from None
