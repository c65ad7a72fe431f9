"""The time budget's plugin (tests/_budget.py) on a tiny project of its own: parts timed with their fixtures,
judged over a whole run only (across make test's two sessions through its JSON), scaled, and failing the
session with a clear line when a part or the whole is over."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SLOW = "import time\n\ndef test_slow():\n    time.sleep(0.3)\n"
FAST = "def test_fast():\n    pass\n"


@pytest.fixture
def project(pytester: pytest.Pytester):
    """tests/a (one slow test, its time half in a fixture), tests/b (fast), a top-level file and a hypothesis
    test; `budgets(...)` writes the table."""
    pytester.makepyfile(
        **{
            "tests/a/test_a.py": "import time, pytest\n\n@pytest.fixture\ndef paid():\n    time.sleep(0.15)\n\n"
            "def test_slow(paid):\n    time.sleep(0.15)\n",
            "tests/b/test_b.py": FAST,
            "tests/test_top.py": FAST,
            "tests/b/test_props.py": "import time\nfrom hypothesis import given, settings, strategies as st\n\n"
            "@settings(max_examples=3, deadline=None)\n@given(st.integers())\ndef test_prop(x):\n"
            "    time.sleep(0.01)\n",
        }
    )

    def budgets(a: float, whole: float = 60) -> None:
        pytester.makefile(
            ".toml",
            pyproject='[tool.pytest.ini_options]\n[tool.tinypaged.test-budgets]\n"tests" = 5\n'
            f'"tests/a" = {a}\n"tests/b" = 5\nfuzz = 5\nwhole = {whole}\n',
        )

    budgets(5)
    return budgets


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_inprocess("-p", "_budget", "-p", "no:cacheprovider", *args)


def test_a_whole_run_within_budget_passes_and_writes_its_table(pytester, project) -> None:
    result = _run(pytester, "tests", "--budget-json=t.json")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*time budget*", "tests/a *", "fuzz *"])
    table = json.loads((pytester.path / "t.json").read_text())
    assert table["judged"] and not table["over"]
    assert 0.3 <= table["parts"]["tests/a"]["seconds"] < 5  # the fixture's setup counted with its test
    assert table["parts"]["fuzz"]["seconds"] > 0 and table["parts"]["tests/b"]["budget"] == 5


def test_a_part_over_its_budget_fails_the_session(pytester, project) -> None:
    project(a=0.1)
    result = _run(pytester, "tests")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["over budget: tests/a took 0.3 s, its budget is 0.1 s", "*4 passed*"])
    assert _run(pytester, "tests", "--budget-scale=20").ret == 0  # a slower machine's allowance


def test_the_whole_over_its_budget_fails(pytester, project) -> None:
    project(a=5, whole=0.1)
    result = _run(pytester, "tests")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["over budget: whole took *"])


@pytest.mark.parametrize(
    "args",
    [["tests", "-k", "slow"], ["tests/a"], ["tests", "--ignore=tests/b"], ["tests/a/test_a.py::test_slow"]],
)
def test_a_partial_run_is_not_judged(pytester, project, args) -> None:
    project(a=0.1)
    result = _run(pytester, *args)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["budgets not judged (a partial run*"])


def test_a_new_folder_without_a_budget_is_over(pytester, project) -> None:
    pytester.makepyfile(**{"tests/c/test_c.py": FAST})
    result = _run(pytester, "tests")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["over budget: tests/c *(no budget in *"])


def test_two_sessions_are_judged_together(pytester, project) -> None:
    """make test's two pytest processes: the first leaves tests/a out; the second, on tests/a alone, merges
    the first's JSON and judges the whole suite."""
    project(a=0.1)
    first = _run(pytester, "tests", "--ignore=tests/a", "--budget-json=t.json")
    assert first.ret == 0 and not json.loads((pytester.path / "t.json").read_text())["judged"]
    second = _run(pytester, "tests/a", "--budget-json=t.json")
    assert second.ret == pytest.ExitCode.TESTS_FAILED
    table = json.loads((pytester.path / "t.json").read_text())
    assert table["judged"] and len(table["sessions"]) == 2 and "tests/b" in table["sessions"][0]["seconds"]
    # A new whole run replaces the file: an older run's sessions are not summed with it.
    _run(pytester, "tests", "--budget-json=t.json")
    assert len(json.loads((pytester.path / "t.json").read_text())["sessions"]) == 1


def test_the_parts_fit_in_the_whole_and_the_whole_in_40_minutes() -> None:
    budgets = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["tinypaged"]
    table = dict(budgets["test-budgets"])
    whole = table.pop("whole")
    assert sum(table.values()) <= whole <= 40 * 60, table
