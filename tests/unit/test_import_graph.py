"""The modules of client/, workers/ and service/ import each other without circles.

A circle (a imports b, b imports a) makes a module's names depend on which of the two
was imported first, and makes the pair one piece that cannot be changed apart; an
import inside a function delays the circle, it does not remove it, so those count too.
Where a base module picks among its variants (storage over local disk or object stores,
capture engines), a registry maps a name to the variant's module path and imports it
when it is first asked for (as vLLM's KVConnectorFactory does), so the base never
imports them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TREES = ("client", "workers", "service")

BASES = {
    "hsx.output.storage": ["hsx.output.local_storage", "hsx.output.object_storage"],
    "hsx_workers.engines.base": ["hsx_workers.engines.vllm.engine",
                                 "hsx_workers.engines.hf_engine"],
    "hsx_workers.engines.factory": ["hsx_workers.engines.vllm.engine",
                                    "hsx_workers.engines.hf_engine"],
}


@pytest.mark.parametrize("base", sorted(BASES))
def test_a_base_module_imports_none_of_its_variants(base: str) -> None:
    code = textwrap.dedent(f"""
        import importlib, sys
        importlib.import_module({base!r})
        print(",".join(m for m in {BASES[base]!r} if m in sys.modules))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing {base} imported {result.stdout.strip()}"


def _modules() -> dict[str, Path]:
    """Every module of the three trees by its dotted name (a package by its own)."""
    found: dict[str, Path] = {}
    for tree in TREES:
        for path in sorted((REPO / tree).rglob("*.py")):
            parts = path.relative_to(REPO / tree).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _run_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that can run: at module level, in classes and compound statements,
    and inside functions (an import there runs when the function is first called, and
    a pair of modules each needing the other is one piece whenever that happens); not
    under `if TYPE_CHECKING:` (only type checkers run it)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
            yield from _run_statements(stmt.orelse)
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from _run_statements(getattr(stmt, field, []))
        for clause in [*getattr(stmt, "handlers", []), *getattr(stmt, "cases", [])]:
            yield from _run_statements(clause.body)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the trees that `name` imports, at import time or in a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for stmt in _run_statements(ast.parse(path.read_text(), str(path)).body):
        if isinstance(stmt, ast.Import):
            out.update(a.name for a in stmt.names if a.name in modules)
        elif isinstance(stmt, ast.ImportFrom):
            base = stmt.module or ""
            if stmt.level:
                anchor = package.split(".")[: len(package.split(".")) - stmt.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in stmt.names:
                target = f"{base}.{alias.name}"
                if target in modules:  # `from package import module`
                    out.add(target)
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the component's first module, for the message."""
    start, members = component[0], set(component)
    trail, seen = [start], {start}
    while True:
        step = sorted(graph[trail[-1]] & members)
        if start in step and len(trail) > 1:
            return [*trail, start]
        nxt = next((m for m in step if m not in seen), None)
        if nxt is None:
            return [*trail, "..."]
        trail.append(nxt)
        seen.add(nxt)


def test_no_module_imports_one_that_imports_it_back() -> None:
    """Edges of the graph: every import a module can run, at module level (and in class
    bodies and compound statements there) and inside functions: an import moved into a
    function to break a circle only hides it. `import a.b` is an edge to `a.b`;
    `from a import b` is an edge to `a.b` where b is a module, else to `a`. Imports under
    `if TYPE_CHECKING:`, which only type checkers run, are not edges; nor is a factory's
    `importlib.import_module` of a registered variant (a name, not an import
    statement: see hsx.registry). A package's `__init__` running
    before its submodules is not an edge either: a package whose `__init__` exports its
    submodules' names would otherwise be a circle with each of them."""
    modules = _modules()
    assert "hsx.output.storage" in modules and "hsx_service.main" in modules
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    circles = [" -> ".join(_path(graph, c)) for c in _circles(graph)]
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_graph_sees_a_circle(tmp_path: Path) -> None:
    """The walk above finds what it is meant to: circles at module level and through
    functions, not through `if TYPE_CHECKING:`."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nfrom pkg import b\n"
                              "if TYPE_CHECKING:\n    from pkg.c import C\nA = 1\n")
    (pkg / "b.py").write_text("class B:\n    from pkg.a import A\n")
    (pkg / "c.py").write_text("def f():\n    from pkg.d import D\n"
                              "try:\n    from . import a\nexcept ImportError:\n    pass\n")
    (pkg / "d.py").write_text("D = 1\nclass E:\n    def g(self):\n        from pkg import c\n")
    modules = {"pkg": pkg / "__init__.py", **{f"pkg.{m}": pkg / f"{m}.py" for m in "abcd"}}
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"},
                     "pkg.c": {"pkg.a", "pkg.d"}, "pkg.d": {"pkg.c"}}
    assert _circles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    assert _path(graph, ["pkg.a", "pkg.b"]) == ["pkg.a", "pkg.b", "pkg.a"]


def test_the_job_driver_re_exports_nothing() -> None:
    """Whatever is imported from runner.py is defined there: the engine pool's names come
    from engine_pool.py, the dispatcher's from dispatch.py, the job's errors from
    errors.py, so each name has one module to look for it in."""
    runner = REPO / "service" / "hsx_service" / "runner.py"
    owned = {node.name for node in ast.parse(runner.read_text()).body
             if isinstance(node, ast.FunctionDef | ast.ClassDef)}
    owned |= {target.id for node in ast.parse(runner.read_text()).body
              if isinstance(node, ast.Assign | ast.AnnAssign)
              for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
              if isinstance(target, ast.Name)}
    through: list[str] = []
    for tree in (*TREES, "tests", "benchmarks"):
        for path in sorted((REPO / tree).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module == "hsx_service.runner":
                    through += [f"{path.relative_to(REPO)}: {alias.name}"
                                for alias in node.names if alias.name not in owned]
    assert "run_job" in owned and "EnginePool" not in owned
    assert not through, "imported through runner.py:\n" + "\n".join(through)
