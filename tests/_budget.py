"""The suite's time budget: each part of tests/ (a folder, the top-level files, and the fuzz and property tests
wherever they live) has a budget in seconds in pyproject.toml's `[tool.tinypaged.test-budgets]`, as measured on
a fresh 2-core CI machine; this plugin times every test (setup + call + teardown, so a fixture's setup counts
for the test that paid it), prints a table at the end, writes it as JSON when asked, and fails the session when
a part, or the whole, goes over. Budgets are judged only over a whole suite: a partial run (a file, `-k`, `-x`
stopping early, a folder left out) prints its table and judges nothing. docs/testing.md says more."""

from __future__ import annotations

import json
import os
import time
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

FUZZ = "fuzz"  # every hypothesis test (schemathesis's and the stateful machines' included)
WHOLE = "whole"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("budget", "the suite's time budget (docs/testing.md)")
    group.addoption(
        "--budget-json",
        default=os.environ.get("TINYPAGED_BUDGET_JSON"),
        help="write the budget table as JSON to this file; a file a whole earlier session of the same run left "
        "(make test runs two) is merged, so the whole is judged across both (env TINYPAGED_BUDGET_JSON)",
    )
    group.addoption(
        "--budget-scale",
        type=float,
        default=float(os.environ.get("TINYPAGED_BUDGET_SCALE", "1")),
        help="multiply every budget, for a machine slower than the CI's (env TINYPAGED_BUDGET_SCALE)",
    )


def pytest_configure(config: pytest.Config) -> None:
    budgets = _read_budgets(config)
    if budgets and not config.getoption("collectonly"):
        config.pluginmanager.register(Budget(config, budgets), "tinypaged-budget")


def _read_budgets(config: pytest.Config) -> dict[str, float]:
    path = config.rootpath / "pyproject.toml"
    if not path.is_file():
        return {}
    table = tomllib.loads(path.read_text()).get("tool", {}).get("tinypaged", {}).get("test-budgets", {})
    return {part: float(seconds) for part, seconds in table.items()}


class Budget:
    """One session's timing, per part; see the module docstring."""

    def __init__(self, config: pytest.Config, budgets: dict[str, float]) -> None:
        self.config = config
        self.budgets = budgets
        self.scale: float = config.getoption("budget_scale")
        self.folders = self._folders()  # "tests" (its top-level files), "tests/core", ...
        self.part_of: dict[str, str] = {}  # nodeid -> part
        self.seconds: dict[str, float] = {}
        self.files_seen: set[Path] = set()
        self.partial: list[str] = []  # why this session is not a whole one
        self.started = time.monotonic()
        self.over: list[str] = []

    def _folders(self) -> list[str]:
        """The parts that are folders: the top-level files and every folder of tests/ that holds test files,
        whether it has a budget or not (one without is over its budget of 0)."""
        tests = self.config.rootpath / "tests"
        folders = tests.iterdir() if tests.is_dir() else []
        found = {f"tests/{d.name}" for d in folders if d.is_dir() and self._test_files(d)}
        return ["tests", *sorted(found | {p for p in self.budgets if p not in (FUZZ, WHOLE, "tests")})]

    def _test_files(self, folder: Path) -> set[Path]:
        if not folder.is_dir():
            return set()
        patterns = self.config.getini("python_files")
        files = folder.glob("*.py") if folder == self.config.rootpath / "tests" else folder.rglob("*.py")
        return {f.resolve() for f in files if any(fnmatch(f.name, p) for p in patterns)}

    # What ran: every test file whose tests pytest collected (a folder's collection alone lists files it does not
    # open), whether anything was deselected or the session stopped early.
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if "::" not in report.nodeid and report.nodeid.endswith(".py"):
            self.files_seen.add((self.config.rootpath / report.nodeid).resolve())

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        if items:
            self.partial.append(f"{len(items)} tests deselected")

    @pytest.hookimpl(trylast=True)  # after hypothesis's plugin has marked its tests
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            self.part_of[item.nodeid] = self._part(item)

    def _part(self, item: pytest.Item) -> str:
        if item.get_closest_marker("hypothesis"):
            return FUZZ
        rel = item.path.resolve().relative_to(self.config.rootpath).parts
        return "/".join(rel[:2]) if len(rel) > 2 else rel[0]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        part = self.part_of.get(report.nodeid)
        if part is not None:
            self.seconds[part] = self.seconds.get(part, 0.0) + report.duration

    # Whether this session was a whole one, part by part.
    def _complete(self, session: pytest.Session) -> set[str]:
        """The folders whose every test file was collected whole in this session."""
        if session.shouldstop or session.shouldfail or session.exitstatus not in (0, 1):
            self.partial.append("the session stopped early")
        if any("::" in arg for arg in self.config.args):
            self.partial.append("tests named one by one")
        if self.config.getoption("lf", False):
            self.partial.append("--last-failed")
        if self.partial:
            return set()
        return {f for f in self.folders if self._test_files(self.config.rootpath / f) <= self.files_seen}

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        complete = self._complete(session)
        ran = {p for p in self.seconds if p != FUZZ}
        this = {
            "wall_s": time.monotonic() - self.started,
            "seconds": self.seconds,
            "complete": sorted(complete),
            "whole": not self.partial and ran <= complete,  # every part it ran, it ran whole
        }
        sessions = [this]
        path = self.config.getoption("budget_json")
        if path and this["whole"] and Path(path).is_file():
            earlier = json.loads(Path(path).read_text()).get("sessions", [])
            # Whole earlier sessions of other folders (make test's first pytest) are merged; if any ran one
            # of these folders, the file is an older run's, and is replaced.
            if all(s["whole"] and not set(s["complete"]) & complete for s in earlier):
                sessions = earlier + sessions
        self.table = self._table(sessions)
        if path:
            Path(path).write_text(json.dumps(self.table, indent=1) + "\n")
        if self.table["judged"] and self.over and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _table(self, sessions: list[dict]) -> dict:
        seconds: dict[str, float] = {}
        for s in sessions:
            for part, t in s["seconds"].items():
                seconds[part] = seconds.get(part, 0.0) + t
        complete = set().union(*(s["complete"] for s in sessions))
        missing = [f for f in self.folders if f not in complete]
        judged = all(s["whole"] for s in sessions) and not missing
        seconds[WHOLE] = sum(s["wall_s"] for s in sessions)
        parts = {}
        for part in dict.fromkeys([*self.folders, FUZZ, *sorted(set(seconds) - {WHOLE}), WHOLE]):
            budget = self.budgets.get(part, 0.0) * self.scale
            t = seconds.get(part, 0.0)
            parts[part] = {
                "seconds": round(t, 2),
                "budget": budget,
                "share": round(t / budget, 3) if budget else None,
            }
            if judged and t > budget:
                self.over.append(
                    f"over budget: {part} took {t:.1f} s, its budget is {budget:.1f} s"
                    + (f" ({self.budgets.get(part, 0):.1f} s x{self.scale:g})" if self.scale != 1 else "")
                    + ("" if part in self.budgets else " (no budget in [tool.tinypaged.test-budgets])")
                )
        why = self.partial or [f"not run whole: {', '.join(missing)}"]
        return {
            "judged": judged,
            "not_judged_because": [] if judged else why,
            "scale": self.scale,
            "parts": parts,
            "over": self.over,
            "sessions": sessions,
        }

    def pytest_terminal_summary(self, terminalreporter) -> None:  # noqa: ANN001
        table = getattr(self, "table", None)
        if table is None:
            return
        tr = terminalreporter
        tr.section("time budget (pyproject.toml [tool.tinypaged.test-budgets]; docs/testing.md)")
        tr.write_line(f"{'part':<16}{'seconds':>9}{'budget':>9}{'share':>8}")
        for part, row in table["parts"].items():
            share = f"{row['share']:.0%}" if row["share"] is not None else "-"
            tr.write_line(f"{part:<16}{row['seconds']:>9.1f}{row['budget']:>9g}{share:>8}")
        if not table["judged"]:
            tr.write_line(f"budgets not judged (a partial run: {'; '.join(table['not_judged_because'])})")
        for line in table["over"]:
            tr.write_line(line, red=True, bold=True)
