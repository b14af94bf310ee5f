"""The generated config reference (docs/guide/config-reference.md), `config explain` and `config show --doc`.

The page is regenerated here and compared: a field added, renamed, retyped, re-defaulted or
re-documented in megatron_dapo/config/*.py without `python -m megatron_dapo.config.reference >
docs/guide/config-reference.md` fails this test.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from megatron_dapo import cli
from megatron_dapo.config import Config, load_config, to_dict
from megatron_dapo.config import reference as ref

ROOT = Path(__file__).resolve().parents[2]


def _leaf_paths(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        out += _leaf_paths(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    return out


def test_the_committed_page_is_the_generated_one() -> None:
    page = (ROOT / ref.PAGE).read_text()
    assert page == ref.render(), f"{ref.PAGE} is out of date with megatron_dapo/config; regenerate: {ref.REGENERATE}"


def test_every_key_of_the_config_is_on_the_page_with_its_docstring() -> None:
    table = ref.keys()
    # Walked independently of the reference module: the config as `config show` prints it.
    assert sorted(table) == sorted(_leaf_paths(to_dict(Config())))
    page = (ROOT / ref.PAGE).read_text()
    for key in table.values():
        assert key.doc, f"{key.name} has no docstring (a string literal under the field)"
        assert f"**`{key.name}`** (`{key.type}`" in page, key.name


def _section_module(tmp_path: Path, extra_field: str) -> type:
    """A config-like dataclass in a module of its own, so its source (the docstrings) is readable."""
    src = f'''
from dataclasses import dataclass, field

@dataclass(kw_only=True)
class Inner:
    """An inner section."""

    depth: int = 3
    """How deep."""
{extra_field}

@dataclass(kw_only=True)
class Root:
    inner: Inner = field(default_factory=Inner)
'''
    name = f"refmod_{abs(hash(extra_field))}"
    (tmp_path / f"{name}.py").write_text(src)
    spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod.Root


def test_a_field_added_changes_the_page(tmp_path) -> None:
    before = ref.render(_section_module(tmp_path, "")())
    after = ref.render(_section_module(tmp_path, '    width: float = 0.5\n    """How wide."""\n')())
    assert "**`inner.depth`** (`int`, default `3`): How deep." in before
    assert "inner.width" not in before
    assert "- **`inner.width`** (`float`, default `0.5`): How wide." in after
    assert before != after


def test_markdown_is_escaped_in_docstrings() -> None:
    assert ref._md("writes <output_dir>/x at 2*N") == "writes &lt;output_dir>/x at 2\\*N"


def test_explain_prints_type_default_and_meaning(capsys) -> None:
    assert cli.run(["config", "explain", "algorithm.clip_ratio_high"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("algorithm.clip_ratio_high: float | null (default null)\n")  # null: the loss mode's
    assert ref.field_docs(type(Config().algorithm))["clip_ratio_high"] in out


def test_explain_of_a_section_lists_its_keys(capsys) -> None:
    assert cli.run(["config", "explain", "algorithm.filter_groups"]) == 0
    out = capsys.readouterr().out
    names = [f.name for f in dataclasses.fields(type(Config().algorithm.filter_groups))]
    assert [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")] == [
        f"algorithm.filter_groups.{n}" for n in names]


@pytest.mark.parametrize("key", ["algorithm.clip_ratio_hig", "trainer.no_such_key"])
def test_explain_of_an_unknown_key_is_one_line_exit_2(capsys, key) -> None:
    assert cli.run(["config", "explain", key]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and key in err and "no such config key" in err
    if key == "algorithm.clip_ratio_hig":
        assert "did you mean algorithm.clip_ratio_high" in err


def test_show_doc_reads_back_to_the_same_config_with_every_note(tmp_path, capsys) -> None:
    example = ROOT / "examples" / "tiny_cpu.yaml"
    assert cli.run(["config", "show", "--doc", str(example), "optim.lr=3e-4"]) == 0
    out = capsys.readouterr().out
    (tmp_path / "annotated.yaml").write_text(out)
    assert load_config(tmp_path / "annotated.yaml") == load_config(example, ["optim.lr=3e-4"])
    comments = " ".join(line.strip().lstrip("# ") for line in out.splitlines() if line.strip().startswith("#"))
    for key in ref.keys().values():
        assert " ".join(key.doc.split()[:4]) in comments, key.name
    assert yaml.safe_load(out)["optim"]["lr"] == 3e-4
