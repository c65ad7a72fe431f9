"""The layers hold, read from the source: no import cycles between tinypaged's modules; core/ imports neither
torch nor the engine; the server, the config and the engine's client protocol reach no torch at all."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it is installed as (kernels/ and weights/ are mapped into tinypaged).
PACKAGES = {
    ROOT / "tinypaged": "tinypaged",
    ROOT / "kernels": "tinypaged.kernels",
    ROOT / "weights": "tinypaged.weights",
}


def _module_files() -> dict[str, Path]:
    files = {}
    for folder, package in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([package, *parts])] = path
    return files


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: set[str], at_import: bool) -> set[str]:
    """What a module imports: tinypaged modules by full name, other packages by their top-level name. Every
    import (inside functions, under `if TYPE_CHECKING:` too), or with `at_import` only those that run when the
    module is imported."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            lazy = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if at_import and (lazy or (isinstance(child, ast.If) and _is_type_checking(child))):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - child.level + 1]
                        + ([base] if base else [])
                    )
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in modules else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    out = set()
    for target in found:
        if target.startswith("tinypaged"):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            out.add(target)
        else:
            out.add(target.split(".")[0])
    out.discard(name)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """Every import edge, lazy and type-checking ones included: a cycle through any of them is a knot."""
    files = _module_files()
    return {name: _imports(name, path, set(files), at_import=False) for name, path in files.items()}


@pytest.fixture(scope="module")
def import_graph() -> dict[str, set[str]]:
    """The imports that run when a module is imported."""
    files = _module_files()
    return {name: _imports(name, path, set(files), at_import=True) for name, path in files.items()}


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    cycles = []
    for name in graph:
        for dep in graph[name]:
            # A package's __init__ importing its own submodules is not a cycle of the code's layers.
            if dep in graph and not dep.startswith(name + ".") and name in _reach(graph, dep):
                cycles.append(f"{name} -> {dep} -> ... -> {name}")
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))


def test_core_is_pure(graph: dict[str, set[str]]) -> None:
    """Not even lazily: core/ is plain Python over plain data."""
    for name in (n for n in graph if n.startswith("tinypaged.core")):
        reach = _reach(graph, name)
        assert not {"torch", "numpy"} & reach, f"{name} reaches torch or numpy"
        assert not {n for n in reach if n.startswith(("tinypaged.engine", "tinypaged.server"))}, name


@pytest.mark.parametrize(
    "module",
    [
        "tinypaged.server.app",
        "tinypaged.engine.frontend.client",
        "tinypaged.config",
        "tinypaged.replicas.ingress",
        "tinypaged.replicas.router",
    ],
)
def test_no_torch_behind(import_graph: dict[str, set[str]], module: str) -> None:
    """Importing the server loads no torch: it talks to the engine through the client protocol and never
    touches tensors; the config stays light too (`tinypaged --help` builds its flags from it); so do the Ray
    Serve ingress and its router, which tokenize and route but hold no model."""
    reach = _reach(import_graph, module)
    assert "torch" not in reach, (
        f"{module} reaches torch through {sorted(n for n in reach if 'tinypaged' in n)}"
    )


def _layer(module: str) -> str | None:
    """The engine layer a module belongs to ("frontend", "step", "sampling", "device"), or None."""
    parts = module.split(".")
    if parts[:2] == ["tinypaged", "engine"] and len(parts) > 3:
        return parts[2]
    return None


# What each engine layer may import of the others (its own modules and engine/request.py always).
ALLOWED = {
    "frontend": {"step", "sampling"},
    "step": {"sampling", "device", "speculative"},
    "sampling": set(),
    "device": set(),
    "speculative": {"sampling", "device"},
}


def test_engine_layers_point_one_way(graph: dict[str, set[str]]) -> None:
    """The frontend and sampling never import the device side; the device side imports no other layer; no
    layer imports the frontend; the server reaches the engine through the frontend and the step's plain data
    (stats, input checks), never sampling or the device. Lazy imports count too."""
    assert {_layer(n) for n in graph} >= set(ALLOWED), "an engine layer is missing"
    wrong = []
    for name, deps in graph.items():
        mine = _layer(name)
        for dep in deps:
            theirs = _layer(dep)
            if theirs is None or theirs == mine:
                continue
            if mine is None:
                ok = not name.startswith("tinypaged.server") or theirs in {"frontend", "step"}
            else:
                ok = theirs in ALLOWED[mine]
            if not ok:
                wrong.append(f"{name} -> {dep}")
    assert not wrong, "imports against the layers' direction:\n" + "\n".join(sorted(wrong))


def test_request_is_the_shared_vocabulary(graph: dict[str, set[str]]) -> None:
    """engine/request.py imports no engine layer: every layer can use it."""
    deps = graph["tinypaged.engine.request"]
    assert not {d for d in deps if d.startswith("tinypaged.engine")}, deps


def test_every_package_is_installed() -> None:
    """Each package of the source tree is in pyproject.toml's list: a missing one imports from a checkout (the
    editable install) but not from a wheel, as `tinypaged serve` on a VM runs it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join([package, *init.parent.relative_to(folder).parts])
        for folder, package in PACKAGES.items()
        for init in folder.rglob("__init__.py")
    }
    assert not found - listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
