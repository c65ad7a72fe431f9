"""The docs cite code that exists: every file path and every code name in docs/*.md, README.md and BENCHMARKS.md
(whose headline cites its result files) is checked against the tree and the imported modules, so a rename that
leaves a doc behind fails here."""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import tinypaged

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
SPAN = re.compile(r"`([^`\n]+)`")
# A code name: dotted identifiers, maybe called, maybe with a return annotation (`f(x) -> T`).
NAME = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(.*\))?(?:\s*->.*)?$")
PATH = re.compile(r"^[\w.-]+(?:/[\w.*-]*)+$|^[\w-]+\.(?:py|md|toml|json)$")


def _modules() -> list:
    names = ["tinypaged"] + [m.name for m in pkgutil.walk_packages(tinypaged.__path__, "tinypaged.")]
    for mapped in ("tinypaged.kernels", "tinypaged.weights"):  # installed from kernels/ and weights/
        package = importlib.import_module(mapped)
        names += [mapped] + [m.name for m in pkgutil.walk_packages(package.__path__, mapped + ".")]
    return [importlib.import_module(n) for n in dict.fromkeys(names)]


def _known_names() -> set[str]:
    """Every name the code defines: modules, module attributes, class members and fields, attributes set on
    `self`, and parameters."""
    known: set[str] = set(dir(builtins))
    for module in _modules():
        known.update(module.__name__.split("."))
        known.update(vars(module))
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                known.add(node.name)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                known.update(a.arg for a in node.args.args + node.args.kwonlyargs)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                known.add(node.target.id)  # dataclass and Struct fields
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                known.add(node.attr)
            elif isinstance(node, ast.Assign):
                known.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return known


def _spans(doc: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # fenced blocks: code shown, not cited
    return SPAN.findall(text)


def _path_exists(span: str) -> bool:
    """A path of the tree, written from the repository root, from tinypaged/, or as installed (kernels/ and
    weights/ are tinypaged/kernels/ and tinypaged/weights/); a bare file name anywhere in the tree."""
    span = re.sub(r"^tinypaged/(kernels|weights)\b", r"\1", span.rstrip("/"))
    if "/" not in span:
        return any(p for p in ROOT.rglob(span) if ".venv" not in p.parts and ".git" not in p.parts)
    return any(list(base.glob(span)) for base in (ROOT, ROOT / "tinypaged"))


def _library_name(parts: list[str]) -> bool:
    try:
        obj = importlib.import_module(parts[0])
        for part in parts[1:]:
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return False
    return True


@pytest.fixture(scope="module")
def known() -> set[str]:
    return _known_names()


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_docs_cite_existing_code(doc: Path, known: set[str]) -> None:
    missing = []
    for span in _spans(doc):
        if PATH.match(span):
            if not _path_exists(span):
                missing.append(span)
            continue
        m = NAME.match(span)
        if m is None or span.isupper() or span.startswith(("-", "http")):
            continue  # flags, shell lines, JSON, environment variables: not code names
        parts = m.group(1).split(".")
        if len(parts) == 1 and "_" not in parts[0] and not parts[0][:1].isupper() and "(" not in span:
            continue  # a plain word (an API parameter such as `n` or `stream`)
        # Each component must be something the code defines (variables such as `seq.` stand for instances),
        # or the whole a library's name (`torch.cuda.Event`).
        unknown = [
            p for p in parts if p not in known and not (p == parts[0] and p.islower() and len(parts) > 1)
        ]
        if unknown and not _library_name(parts):
            missing.append(span)
    assert not missing, f"{doc.name} cites names or paths the code does not have: {missing}"
