"""The documents point at things that exist: every relative link names a file of the
repository and, after `#`, one of its headings (GitHub's anchors); every
`docs/X.md, "Section"` reference names a heading of that file (or a paragraph's bold
lead-in); every `tests/...py::name`
names a test that is defined there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
               *(ROOT / d / "README.md" for d in ("deploy", "benchmarks", "docker"))])
LINK = re.compile(r"\]\(([^)\s]+)\)")
SECTION_REF = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.md), \"([^\"]+)\"")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(test_\w+)")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces
    as `-`, the n-th repeat suffixed `-n`; headings inside code blocks are not headings."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        text = re.sub(r"`|\*\*", "", line.lstrip("#").strip())
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


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
def test_links_and_anchors_exist(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path_text, _, anchor = target.partition("#")
        path = _resolve(doc, path_text) if path_text else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with that anchor in {path.name}")
    assert not broken, broken


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


def test_the_anchor_rule_on_known_headings(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("# Placement: who uses the GPUs\n```\n# not a heading\n```\n"
                   "## `hsx train` on a bucket (s3://)\n## Notes\n## Notes\n")
    assert anchors(doc) == {"placement-who-uses-the-gpus", "hsx-train-on-a-bucket-s3",
                            "notes", "notes-1"}
