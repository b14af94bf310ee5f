"""One meaning per exit code: train.py's table, errors.py's user error, and the sbatch script's own stops."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_dapo import errors, train

REPO = Path(__file__).resolve().parents[2]


def _codes() -> dict[str, int]:
    codes = {name: value for name, value in vars(train).items() if name.startswith("EXIT_")}
    codes["EXIT_USER_ERROR"] = errors.EXIT_USER_ERROR
    return codes


def test_each_exit_code_has_one_meaning() -> None:
    codes = _codes()
    assert len(codes) >= 8 and 0 not in codes.values()
    assert len(set(codes.values())) == len(codes), codes


def test_the_sbatch_scripts_stop_at_max_requeues_with_a_code_of_its_own() -> None:
    """dapo.sbatch stopped at MAX_REQUEUES with 3, the code of 'dynamic sampling could not fill a batch'."""
    text = (REPO / "slurm" / "dapo.sbatch").read_text()
    block = text[text.index("if ((ATTEMPT >= ${MAX_REQUEUES"):]
    code = int(re.search(r"\n\s*exit (\d+)", block).group(1))
    assert code == train.EXIT_REQUEUES_EXHAUSTED
    assert [name for name, value in _codes().items() if value == code] == ["EXIT_REQUEUES_EXHAUSTED"]
    # Every other literal exit of the launcher is a user error (2) or success (0), or passes the ranks' code on.
    literal = sorted({int(c) for c in re.findall(r"^\s*exit (\d+)", text, re.M)})
    assert literal == [0, errors.EXIT_USER_ERROR, train.EXIT_REQUEUES_EXHAUSTED]
    assert f"$RC -eq {train.EXIT_NOTHING_TO_TRAIN} " in text and f"$RC -eq {train.EXIT_PREEMPTED} " in text


def test_design_md_names_every_exit_code() -> None:
    text = (REPO / "docs" / "DESIGN.md").read_text()
    entry = text[text.index("- **Exit codes of `train`**"):]
    entry = entry[:entry.index("\n- ")]
    for name, value in _codes().items():
        assert re.search(rf"(?<![\d.]){value}(?![\d.])", entry), (name, value)
