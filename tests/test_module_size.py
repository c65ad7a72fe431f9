"""No module of tinypaged/, kernels/ or weights/ past MAX_LINES lines unless its docstring says why it is one
job: a paragraph that opens "One job" and gives the reason (core/scheduler.py's does). docs/testing.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450
# A paragraph of the module docstring that opens "One job" and goes on to give a reason, not the words alone.
ONE_JOB = re.compile(r"(?:^|\n\s*\n)\s*One job\b.{60,}", re.S)


def _offenders(root: Path) -> list[str]:
    out = []
    for folder in ("tinypaged", "kernels", "weights"):
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text()
            lines = len(text.splitlines())
            doc = ast.get_docstring(ast.parse(text)) or ""
            if lines > MAX_LINES and not ONE_JOB.search(doc):
                out.append(
                    f"{path.relative_to(root)}: {lines} lines, and its docstring does not say why it is one job"
                )
    return out


def test_long_modules_say_why_they_are_one_job() -> None:
    offenders = _offenders(ROOT)
    assert not offenders, (
        "split these, or open a paragraph of the docstring with 'One job' and why:\n" + "\n".join(offenders)
    )


def test_the_rule_sees_a_long_module_and_its_reason(tmp_path: Path) -> None:
    body = "x = 1\n" * MAX_LINES
    (tmp_path / "tinypaged").mkdir()
    (tmp_path / "tinypaged" / "short.py").write_text('"""Short."""\n' + "x = 1\n" * (MAX_LINES - 1))
    (tmp_path / "tinypaged" / "long.py").write_text('"""Long.\n\nOne job.\n"""\n' + body)
    (tmp_path / "tinypaged" / "why.py").write_text(
        '"""Long.\n\nOne job, in about 460 lines: every policy here reads the budget the others leave.\n"""\n'
        + body
    )
    assert _offenders(tmp_path) == [
        "tinypaged/long.py: 454 lines, and its docstring does not say why it is one job"
    ]
