"""The package's shape: rooms a reader can hold, no import circle, nothing from
the source tree, and every public name (exceptions included) at the top.

The import graph is read from the source (the AST of every module), so it
covers modules whose imports a test run would never trigger. It counts every
import between our modules, at module level and inside functions alike: a
lazy import may keep torch out of `import dtralloc`, but it must not hide a
circle between two of our own modules.
"""
from __future__ import annotations

import __future__
import ast
import importlib
import inspect
import sys
import types
from pathlib import Path

import dtralloc

PACKAGE_DIR = Path(dtralloc.__file__).parent
MAX_LINES = 500  # a file one reader can hold (issue 12); split along a seam past this


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that ``name`` imports anywhere in its source. ``from P import x``
    depends on submodule ``P.x`` when there is one (it runs first; the compiled
    ``_core`` is one too, a leaf), else on ``P``."""
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [sub if (sub := f"{source}.{alias.name}") in modules or sub in sys.modules
                       else source for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["dtralloc.trace"] >= {"dtralloc.trace.model"}, "the graph reader misses imports"
    assert "dtralloc.trace.recorder" in graph["dtralloc.zoo.registry"]
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_never_imports_the_source_tree():
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            roots = []
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                roots = [node.module.split(".")[0]]
            assert not {"bench", "tests"} & set(roots), f"{name} imports {roots} (line {node.lineno})"


def test_every_file_is_a_room_one_reader_can_hold():
    long = {str(p.relative_to(PACKAGE_DIR)): n for p in PACKAGE_DIR.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these along a seam the design has: {long}"


def test_all_lists_exactly_what_the_package_exports():
    exported = {n for n, v in vars(dtralloc).items() if not n.startswith("_")
                and not isinstance(v, (types.ModuleType, __future__._Feature))}
    public_rooms = {"trace"}  # subpackages the top level hands out by name
    assert set(dtralloc.__all__) == exported | public_rooms
    assert all(hasattr(dtralloc, n) for n in dtralloc.__all__)
    assert callable(dtralloc.replay), "dtralloc.replay is the function, not the subpackage"


def test_every_exception_the_package_defines_is_exported():
    """Users catch what we raise on purpose by its name at the top level."""
    defined = {}
    for name in _modules():
        if name == "dtralloc.__main__":
            continue  # runs the command line when imported
        module = importlib.import_module(name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__.startswith("dtralloc")):
                defined[name] = obj
    assert {"ConfigError", "InvalidPointerError", "OutOfMemoryError", "InstallError"} <= set(defined)
    for name, cls in defined.items():
        assert getattr(dtralloc, name, None) is cls, f"dtralloc.{name} is not exported"
        assert name in dtralloc.__all__
