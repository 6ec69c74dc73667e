"""docs/MODELS.md's table of architectures ("Architectures tested on the CPU machine")
says what the code does: it names exactly the architectures of `ARCHS`, and every one it
claims as tested is run by the test it names (read from the test modules' source, so
no engine starts and nothing heavy is imported)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from hsx_workers.tiny_models.models import ARCHS

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Architectures tested on the CPU machine"
TESTS = ROOT / "tests" / "integration"


def arch_table() -> dict[str, tuple[str, str]]:
    """arch -> (capture path, outcome), from the table under HEADING."""
    text = (ROOT / "docs" / "MODELS.md").read_text()
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    if header[:1] != ["arch"] or "capture" not in header or "outcome" not in header:
        raise AssertionError(f"unexpected table header: {header}")
    for line in lines[2:]:  # after the header and its rule
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        arch = cells[0].strip("`")
        if arch in rows:
            raise AssertionError(f"{arch} has two rows")
        rows[arch] = (cells[header.index("capture")], cells[header.index("outcome")])
    return rows


def dict_keys(path: Path, name: str) -> set[str]:
    """The string keys of the module-level dict `name` in a Python file."""
    for node in ast.parse(path.read_text()).body:
        target: ast.expr
        value: ast.expr | None
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == name and isinstance(value, ast.Dict):
            return {k.value for k in value.keys
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    raise AssertionError(f"no dict {name} in {path}")


def tested_by() -> dict[str, set[str]]:
    """arch -> the test files that run it through vLLM against a reference."""
    found: dict[str, set[str]] = {}
    archs_file = TESTS / "test_archs.py"
    for arch in dict_keys(archs_file, "CASES") | dict_keys(archs_file, "WRAPPER_CASES"):
        found.setdefault(arch, set()).add("test_archs.py")
    # test_extract.py compares the session's tiny model (tests/conftest.py) with hf.
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    for arch in re.findall(r"make_tiny_model\(.*, \"(\w+)\"\)$", conftest, re.M):
        found.setdefault(arch, set()).add("test_extract.py")
    return found


def test_the_table_names_exactly_the_tiny_architectures() -> None:
    assert sorted(arch_table()) == sorted(ARCHS)


def test_every_arch_claimed_as_tested_is_run_by_that_test() -> None:
    tests = tested_by()
    for arch, (capture, outcome) in arch_table().items():
        assert capture, f"{arch}: no capture path"
        claimed = set(re.findall(r"test_\w+\.py", outcome))
        refused = outcome.lower().startswith("refused")
        assert claimed or refused, f"{arch}: neither a test nor a refusal: {outcome!r}"
        assert claimed <= tests.get(arch, set()), \
            f"{arch}: the table says {sorted(claimed)}, it is run by {sorted(tests.get(arch, []))}"
    # And the other way: an architecture that a test compares is said so in the table.
    table = arch_table()
    for arch, files in tests.items():
        assert arch in table and files <= set(re.findall(r"test_\w+\.py", table[arch][1])), \
            f"{arch} is run by {sorted(files)}, which the table does not say"
