"""One job per room: no module of client/, workers/ or service/ over 700 lines and no
function there over 120, so that a newcomer can read a module, and a step of it, whole.
A module that grows past the limit splits along its seams (as ingest/samples.py left
ingest/pipeline.py, trainer/ and output/shards/ their packages' modules)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TREES = ("client", "workers", "service")
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 120


def _sources() -> list[Path]:
    found = [p for tree in TREES for p in sorted((REPO / tree).rglob("*.py"))]
    assert len(found) > 50, found  # the trees are where this test thinks they are
    return found


def test_no_module_over_700_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_120_lines() -> None:
    long: dict[str, int] = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
