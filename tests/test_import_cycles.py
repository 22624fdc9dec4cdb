"""No file-level import cycle in src/ftexpert.

The graph is built from the source, not from an import: every `import` / `from ... import` of an
ftexpert module anywhere in a file counts as an edge -- at module level, inside functions and under
`if TYPE_CHECKING:` alike (a function-level import is a cycle deferred to the first call, and a
TYPE_CHECKING import is one the type checker still has to untangle). `from pkg import name` is an
edge to `pkg.name` where that is a module, else to `pkg` (its `__init__`), so a package that
re-exports from a submodule which imports the package is a cycle too. Importing `a.b.c` is an edge
to `a.b.c` only (as in import-linter), not to the parents whose `__init__` Python also runs.

A cycle is a strongly connected component of more than one module; the failure lists each one with
the import lines that close it.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT_PACKAGE = "ftexpert"


@dataclass(frozen=True)
class ImportLine:
    importer: str
    imported: str
    path: Path  # relative to the source root
    lineno: int
    text: str


def _module_files(src: Path = SRC, root: str = ROOT_PACKAGE) -> dict[str, Path]:
    files = {}
    for path in sorted((src / root).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if _is_package(path) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def import_lines(src: Path = SRC, root: str = ROOT_PACKAGE) -> list[ImportLine]:
    """Every import of a module of `root` in every file under src/root, wherever it sits in the file."""
    files = _module_files(src, root)
    lines: list[ImportLine] = []
    for module, path in files.items():
        source = path.read_text(encoding="utf-8")
        text = source.splitlines()
        seen: set[tuple[str, int]] = set()  # `from m import a, b`: one edge for the line
        for node in ast.walk(ast.parse(source, filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, path, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in files else base)
            for target in dict.fromkeys(targets):
                # `import ftexpert.a.b` of something that is not a file (a typo, a generated module):
                # the nearest enclosing module that is one.
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != module and (target, node.lineno) not in seen:
                    seen.add((target, node.lineno))
                    lines.append(ImportLine(module, target, path.relative_to(src), node.lineno,
                                            text[node.lineno - 1].strip()))
    return lines


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on a deep chain)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def import_cycles(src: Path = SRC, root: str = ROOT_PACKAGE) -> list[tuple[list[str], list[ImportLine]]]:
    """Each cycle (a strongly connected component of more than one module) with the import lines inside it."""
    lines = import_lines(src, root)
    graph: dict[str, set[str]] = defaultdict(set)
    for module in _module_files(src, root):
        graph[module]
    for line in lines:
        graph[line.importer].add(line.imported)
    cycles = []
    for component in strongly_connected_components(graph):
        if len(component) > 1:
            members = set(component)
            inside = [line for line in lines if line.importer in members and line.imported in members]
            inside.sort(key=lambda line: (line.importer, line.lineno, line.imported))
            cycles.append((component, inside))
    return sorted(cycles)


def _describe(cycles: list[tuple[list[str], list[ImportLine]]]) -> str:
    out = [f"{len(cycles)} import cycle(s) in src/{ROOT_PACKAGE}:"]
    for number, (modules, lines) in enumerate(cycles, 1):
        out.append(f"\ncycle {number}: {', '.join(modules)}")
        for line in lines:
            out.append(f"  {line.importer} -> {line.imported}    ({line.path}:{line.lineno}: {line.text})")
    return "\n".join(out)


def test_no_import_cycle():
    cycles = import_cycles()
    assert not cycles, _describe(cycles)


def test_the_checker_finds_a_cycle(tmp_path):
    """The checker itself: a package re-exporting from a submodule that imports the package, a
    function-level import, a TYPE_CHECKING import and a relative import each close a cycle."""
    pkg = tmp_path / "demo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("NAME = 'demo'\nfrom demo.a import A\n")
    (pkg / "a.py").write_text("from demo import NAME\nA = 1\n")
    (pkg / "helper.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from demo.helper import f\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "x.py").write_text("from ..sub import y\n")
    (pkg / "sub" / "y.py").write_text("import demo.sub.x\n")
    (pkg / "sub" / "z.py").write_text("import demo.sub.y\n")
    cycles = import_cycles(tmp_path, "demo")
    assert [modules for modules, _ in cycles] == [["demo", "demo.a"], ["demo.b", "demo.helper"],
                                                   ["demo.sub.x", "demo.sub.y"]]
    assert {(line.importer, line.imported, line.lineno) for line in cycles[0][1]} == {
        ("demo", "demo.a", 2), ("demo.a", "demo", 1)}
    assert _describe(cycles).count(" -> ") == 6
