"""The config reference, generated from the typed sections: every key, its type, default and docstring.

    python -m megatron_dapo.config.reference > docs/guide/config-reference.md
    megatron-dapo config explain algorithm.clip_ratio_high
    megatron-dapo config show --doc examples/tiny_cpu.yaml

A field's documentation is the string literal right under it in its dataclass (an attribute
docstring, read here from the source with `ast`), so the reference cannot drift from the code:
tests/unit/test_config_reference.py regenerates the page and compares.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import sys
import textwrap
import typing
from dataclasses import dataclass
from typing import Any

import yaml

from megatron_dapo.config.experiment import Config
from megatron_dapo.config.fields import ConfigError
from megatron_dapo.config.loader import _type_name, to_dict

PAGE = "docs/guide/config-reference.md"
REGENERATE = "python -m megatron_dapo.config.reference > docs/guide/config-reference.md"


@dataclass(frozen=True)
class Key:
    """One leaf key of the config: dotted name, type as the loader names it, default, docstring."""

    name: str
    type: str
    default: Any
    doc: str


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} of a dataclass, from the string literal under each annotated field."""
    source = textwrap.dedent(inspect.getsource(sys.modules[cls.__module__]))
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    body = node.body
    for stmt, nxt in zip(body, [*body[1:], None]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def _section_doc(cls: type) -> str:
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split())


def sections(cls: type = Config, value: Any = None, prefix: str = "") -> list[tuple[str, type, list[Key]]]:
    """[(dotted section, its dataclass, its leaf keys)] in declaration order, nested sections after
    their parent; `value` is the instance whose values are the defaults (a default Config)."""
    value = Config() if value is None else value
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    leaves: list[Key] = []
    nested: list[tuple[str, type, list[Key]]] = []
    for f in dataclasses.fields(cls):
        sub = getattr(value, f.name)
        if dataclasses.is_dataclass(sub):
            nested += sections(type(sub), sub, f"{prefix}{f.name}.")
        else:
            leaves.append(Key(prefix + f.name, _type_name(hints[f.name]), sub, docs.get(f.name, "")))
    own = [(prefix.rstrip("."), cls, leaves)] if prefix and leaves else []
    return own + nested


def keys() -> dict[str, Key]:
    """Every leaf key by dotted name."""
    return {k.name: k for _, _, ks in sections() for k in ks}


def _default(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _md(text: str) -> str:
    """A docstring as Markdown text: no HTML tag or emphasis read into `<output_dir>` or `2*N`."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace("*", "\\*")


def render(root: Any = None) -> str:
    """The config reference page (Markdown) of `root` (a default Config unless given)."""
    out = [
        "# Config reference",
        "",
        "Every key of an experiment YAML, by section: its type, its default and what it does. "
        "Set any of them in the YAML or on the command line as `section.key=value` "
        "([Quickstart](quickstart.md)); `megatron-dapo config explain KEY` prints one entry and "
        "`megatron-dapo config show --doc FILE` the resolved config with these notes as comments.",
        "",
        f"<!-- Generated from megatron_dapo/config/*.py by `{REGENERATE}`; do not edit by hand "
        "(tests/unit/test_config_reference.py fails when it is out of date). -->",
        "",
    ]
    root = Config() if root is None else root
    for name, cls, leaves in sections(type(root), root):
        depth = name.count(".")
        out += [f"{'#' * (2 + min(depth, 2))} `{name}`", ""]
        if doc := _section_doc(cls):
            out += [_md(doc), ""]
        for k in leaves:
            line = f"- **`{k.name}`** (`{k.type}`, default `{_default(k.default)}`)"
            out.append(f"{line}: {_md(k.doc)}" if k.doc else line)
        out.append("")
    return "\n".join(out)


def explain(name: str) -> str:
    """A key's entry as plain text (every key of it for a section); an unknown name is a
    ConfigError naming the nearest keys."""
    table = keys()
    if name in table:
        k = table[name]
        return f"{k.name}: {k.type} (default {_default(k.default)})\n  {k.doc}\n"
    under = [k for k in table if k.startswith(name + ".")]
    if under:
        return "".join(explain(k) for k in under)
    hint = difflib.get_close_matches(name, [*table, *(s for s, _, _ in sections())], n=3, cutoff=0.5)
    fix = f"did you mean {', '.join(hint)}?" if hint else f"every key is listed in {PAGE}"
    raise ConfigError(f"{name}: no such config key or section; {fix}")


def annotated_yaml(cfg: Config) -> str:
    """The resolved config as YAML with each key's type, default and docstring in a comment above it."""
    table = keys()
    lines: list[str] = []

    def walk(tree: dict[str, Any], prefix: str, indent: int) -> None:
        pad = " " * indent
        for name, value in tree.items():
            dotted = prefix + name
            if isinstance(value, dict) and dotted not in table:
                lines.append(f"{pad}{name}:")
                walk(value, dotted + ".", indent + 2)
                continue
            k = table[dotted]
            note = f"{k.type}, default {_default(k.default)}" + (f": {k.doc}" if k.doc else "")
            lines.extend(f"{pad}# {part}" for part in textwrap.wrap(note, 100 - indent))
            dumped = yaml.safe_dump({name: value}, sort_keys=False, default_flow_style=False).rstrip("\n")
            lines.extend(pad + part for part in dumped.splitlines())

    walk(to_dict(cfg), "", 0)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
