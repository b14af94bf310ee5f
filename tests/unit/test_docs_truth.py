"""What README.md and the guide state about the code and the measurements, read against them.

- the README's status table against docs/benchmarks.md's "What holds today" table (a GPU date only
  where a GPU row of that date and command exists; every GPU row cited) and against the tests it
  names;
- the set-up times the README gives against the measured ones in docs/benchmarks.md;
- one Python version, setup.py's floor, everywhere the docs name one;
- the troubleshooting page's exit codes against the code's EXIT_* constants;
- where the recipes (pages and YAMLs) say the planner ranks their layout, against `plan`;
- the metric names the monitoring page lists, against the code that logs them;
- the sbatch scripts' cluster block, and the guide's figures about it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import doc_commands as dc
import pytest

ROOT = dc.ROOT
README = (ROOT / "README.md").read_text()
BENCH = (ROOT / "docs" / "benchmarks.md").read_text()
GUIDE = ROOT / "docs" / "guide"
DATE = r"\d{4}-\d{2}-\d{2}"


def _section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end > 0 else None]


def _table(text: str) -> list[list[str]]:
    """The rows of the first Markdown table in `text`, header and rule left out."""
    rows = [ln for ln in text.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in rows[2:]]


def _ticks(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# ---------------------------------------------------------------- status table


STATUS = _table(_section(README, "## What works today"))
TODAY = _table(_section(BENCH, "## What holds today"))
GPU_ROWS = [r for r in TODAY if "H100" in r[2] or "GPU" in r[2]]


def test_status_rows_say_one_thing_each_and_name_real_cpu_tests() -> None:
    assert len(STATUS) >= 10
    for feature, cpu, gpu, not_run in STATUS:
        assert not_run in ("yes", "-"), feature
        assert gpu == "-" or re.fullmatch(rf"{DATE} \(`[^`]+`\)", gpu), (feature, gpu)
        assert not (gpu != "-" and not_run == "yes"), f"{feature}: ran on a GPU and not run on GPUs"
        for path in _ticks(cpu):
            assert path.startswith("tests/") and not path.startswith("tests/gpu/"), (feature, path)
            assert (ROOT / path).is_file() and "def test_" in (ROOT / path).read_text(), (feature, path)
        assert cpu == "-" or _ticks(cpu), (feature, cpu)


def test_a_gpu_date_in_the_readme_is_a_gpu_row_of_benchmarks() -> None:
    cited = set()
    for feature, _, gpu, _ in STATUS:
        if gpu == "-":
            continue
        date, command = re.fullmatch(rf"({DATE}) \(`([^`]+)`\)", gpu).groups()
        rows = [r for r in GPU_ROWS if r[3] == date and command in _ticks(r[4])]
        assert rows, f"README says {feature!r} ran on a GPU on {date} with `{command}`; benchmarks.md has no such GPU row"
        cited.add((date, command))
    for row in GPU_ROWS:
        if row[3] != "-":
            assert any((row[3], c) in cited for c in _ticks(row[4])), f"benchmarks' GPU row {row[0]!r} is not in the README's table"
    dates = {r[3] for r in GPU_ROWS if r[3] != "-"}
    intro = _section(README, "## What works today").split("\n|")[0]
    assert dates and all(d in intro for d in dates), (dates, intro)


# ---------------------------------------------------------------- set-up times


def _rows(command: str) -> list[list[str]]:
    rows = [r for r in TODAY if _ticks(r[4]) == [command]]
    assert rows, f"benchmarks.md's table has no row measured with `{command}`"
    return rows


def _minutes(value: str) -> float:
    if m := re.search(r"(\d+) min (\d+) s", value):
        return int(m.group(1)) + int(m.group(2)) / 60
    return int(re.search(r"in (\d+) s", value).group(1)) / 60


@pytest.mark.parametrize(("command", "measured"), [("make run", "make run"), ("make test", ".ci/run")])
def test_the_readme_gives_the_measured_set_up_times(command: str, measured: str) -> None:
    # One figure per measured machine: "about 27 min on 2 cores (Xeon; 52 on a Zen 4)".
    (line,) = [ln for ln in README.splitlines() if ln.startswith(command + " ")]
    said = [int(re.search(r"about (\d+) min", line).group(1)), *map(int, re.findall(r"; (\d+) on an? ", line))]
    rows = _rows(measured)
    assert sorted(said) == sorted(round(_minutes(r[1])) for r in rows), (line, rows)


# ---------------------------------------------------------------- python version


def test_one_python_version_everywhere() -> None:
    floor = re.search(r'python_requires=">=3\.(\d+)"', (ROOT / "setup.py").read_text()).group(1)
    assert README.count("Python 3.") == 1 and f"Python 3.{floor}" in README
    assert f"python3.{floor} -m venv .venv && . .venv/bin/activate" in README
    for page in [ROOT / "README.md", *GUIDE.glob("*.md")]:
        for para in page.read_text().split("\n\n"):
            if "gpu.txt" in para:  # the GPU pin set names the Pythons it was resolved for
                continue
            for minor in re.findall(r"Python (?:>= ?)?3\.(\d+)", para):
                assert minor == floor, f"{page.name}: Python 3.{minor} where setup.py says >=3.{floor}"


# ---------------------------------------------------------------- exit codes


def _exit_codes() -> dict[int, str]:
    codes: dict[int, str] = {}
    for path in (ROOT / "megatron_dapo").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id.startswith("EXIT_") and isinstance(node.value, ast.Constant)
                    and type(node.value.value) is int):
                name, value = node.targets[0].id, node.value.value
                assert value not in codes or codes[value] == name, f"exit {value} means {codes[value]} and {name}"
                codes[value] = name
    return codes


def test_the_troubleshooting_page_lists_exactly_the_codes_of_the_code() -> None:
    rows = _table(_section((GUIDE / "troubleshooting.md").read_text(), "## Exit codes"))
    page = {int(_ticks(r[0])[0]): (_ticks(r[1]) or ["-"])[0] for r in rows}
    code = _exit_codes()
    assert 2 in code and 75 in code
    assert page == {0: "-", **code}
    assert all(r[2] and r[3] for r in rows), "every exit code says what happened and what to do"


# ---------------------------------------------------------------- planner ranks


RANK = re.compile(r"ranks (?:it|this layout) (\d+)(?:st|nd|rd|th) of\s+(?:the )?(\d+)")


def _plan_rank(command: str) -> tuple[int, int]:
    code, out = dc.run(command)
    assert code == 0, out
    if m := re.search(r"this config's layout: rank (\d+) of (\d+)", out):
        return int(m.group(1)), int(m.group(2))
    (pos,) = re.findall(r"^\s+(\d+)\. .*<- this config$", out, re.M)
    return int(pos), int(re.search(r"layout search: (\d+) of \d+ layouts fit", out).group(1))


def _quoted_ranks() -> list[tuple[str, str, tuple[int, int]]]:
    """(where, plan command, (rank, of)) of every rank the recipes page and the recipe YAMLs state."""
    out = []
    for section in (GUIDE / "recipes.md").read_text().split("\n## ")[1:]:
        plans = [ln[2:] for ln in section.splitlines() if ln.startswith("$ megatron-dapo plan")]
        for m in RANK.finditer(section):
            out.append((f"recipes.md: {section.splitlines()[0]}", plans[0], (int(m.group(1)), int(m.group(2)))))
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        comments = " ".join(ln.strip().lstrip("#").strip() for ln in path.read_text().splitlines()
                            if ln.strip().startswith("#"))
        found = list(RANK.finditer(comments))
        if found:
            (cmd,) = re.findall(r"python tools/plan\.py (\S+\.yaml [^#]*?--gpu-mem-gib \d+)", comments)
            out += [(path.name, f"megatron-dapo plan {cmd}", (int(m.group(1)), int(m.group(2)))) for m in found]
    return out


def test_recipes_say_where_the_planner_ranks_them() -> None:
    quoted = _quoted_ranks()
    assert {w.split(":")[0] for w, _, _ in quoted} >= {"recipes.md", "dapo_qwen2.5_32b.yaml", "dapo_qwen3_30b_a3b.yaml"}
    for where, command, said in quoted:
        assert _plan_rank(command) == said, f"{where} says rank {said}; `{command}` ranks it {_plan_rank(command)}"
    for path in [*GUIDE.glob("*.md"), *(ROOT / "examples").glob("*.yaml"), ROOT / "README.md"]:
        assert "planner's first choice" not in path.read_text(), path


# ---------------------------------------------------------------- metric names


def test_the_metrics_the_monitoring_page_names_are_logged() -> None:
    page = (GUIDE / "monitoring.md").read_text()
    names = {n for n in re.findall(r"`([a-z_]+/[a-z_/]+)`", page) if not n.endswith("/")}
    source = "\n".join(p.read_text() for p in (ROOT / "megatron_dapo").rglob("*.py"))
    timers = set(re.findall(r'timer\("([a-z_]+)"\)', source))
    from megatron_dapo.algo.objective import OBJECTIVE_METRICS  # logged as actor/<name> (actor/actor.py)

    assert len(names) >= 15
    missing = [n for n in sorted(names) if f'"{n}"' not in source
               and not (n.startswith("timing_s/") and n.split("/", 1)[1] in timers)
               and not (n.startswith("actor/") and n.split("/", 1)[1] in OBJECTIVE_METRICS)]
    assert not missing, missing


# ---------------------------------------------------------------- sbatch scripts


SCRIPTS = sorted(p for p in (ROOT / "slurm").glob("*.sbatch") if "#SBATCH" in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_the_cluster_block_is_there_off_and_where_sbatch_reads_it(script: Path) -> None:
    lines = script.read_text().splitlines()
    first_command = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#"))
    for option in ("--partition", "--account", "--qos"):
        assert any(ln.startswith(f"##SBATCH {option}=") for ln in lines), (script.name, option)
        assert not any(ln.startswith(f"#SBATCH {option}") for ln in lines), f"{script.name}: {option} is on"
    directives = [i for i, ln in enumerate(lines) if ln.startswith(("#SBATCH", "##SBATCH"))]
    # sbatch stops reading directives at the first command: a line turned on below it would be ignored.
    assert directives and max(directives) < first_command, script.name


def test_the_guide_quotes_the_scripts_cpus_per_task() -> None:
    page = (GUIDE / "slurm.md").read_text()
    for script in ("dapo_32b.sbatch", "dapo_qwen3_30b_a3b.sbatch"):
        cpus = re.search(r"^#SBATCH --cpus-per-task=(\d+)", (ROOT / "slurm" / script).read_text(), re.M).group(1)
        assert f"the scripts ask {cpus} per task" in page, script
