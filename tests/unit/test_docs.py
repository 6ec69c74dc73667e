"""The documents' prose references point at things that exist: every
`docs/X.md, "Section"` reference names a heading of that file (or a paragraph's bold
lead-in); every `tests/...py::name` names a test that is defined there.

Links (`[text](path#anchor)`) are checked by the docs site's strict build instead
(`make docs`: mkdocs fails on a link to a missing file or heading, in every page).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
               *(ROOT / d / "README.md" for d in ("deploy", "benchmarks", "docker")),
               ROOT / "benchmarks" / "HISTORY.md", ROOT / "benchmarks" / "results" / "INDEX.md"])
SECTION_REF = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.md), \"([^\"]+)\"")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(test_\w+)")


def headings(path: Path) -> list[str]:
    """Headings, and the bold lead-ins that open a paragraph (`**Direct I/O (...).**`)."""
    lines = path.read_text().splitlines()
    return ([re.sub(r"`", "", line.lstrip("#").strip())
             for line in lines if re.match(r"#{1,6} ", line)]
            + [line[2:].split("**")[0] for line in lines if line.startswith("**")])


def _resolve(doc: Path, target: str) -> Path:
    """A path as the document names it: relative to the document, or to the repository
    root (where the prose writes `docs/X.md` from any document)."""
    near = (doc.parent / target).resolve()
    return near if near.exists() else (ROOT / target).resolve()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_section_and_test_references_exist(doc: Path) -> None:
    text = " ".join(doc.read_text().split())  # references wrap across lines
    broken = []
    for name, section in SECTION_REF.findall(text):
        path = _resolve(doc, name)
        if not path.exists():
            broken.append(f'{name}, "{section}": no such file')
        elif not any(h == section or h.startswith(section + " ") or h.startswith(section + ":")
                     for h in headings(path)):
            broken.append(f'{name}, "{section}": no such heading')
    for file, test in TEST_REF.findall(text):
        path = ROOT / file
        if not path.exists() or not re.search(rf"def {test}\(", path.read_text()):
            broken.append(f"{file}::{test}: no such test")
    assert not broken, broken
