"""The documents' prose references point at things that exist: every
`docs/X.md, "Section"` reference names a heading of that file (or a paragraph's bold
lead-in); every `tests/...py::name` names a test that is defined there.

Every draft method hsx trains is named where a user looks first (the README, the CLI
reference, `hsx train --help`, the methods pages), and each method's page gives the
layers, the commands and the `vllm serve` line its code gives.

The reference pages are generated from the code and committed whole (scripts/reference.py).

Links (`[text](path#anchor)`) are checked by the docs site's strict build instead
(`make docs`: mkdocs fails on a link to a missing file or heading, in every page).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from hsx.methods import METHOD_NAMES, METHODS

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
               *(ROOT / d / "README.md" for d in ("deploy", "benchmarks", "docker")),
               ROOT / "benchmarks" / "HISTORY.md", ROOT / "benchmarks" / "results" / "INDEX.md"])
REFERENCE = ROOT / "scripts" / "reference.py"
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


def _reference() -> Any:
    """scripts/reference.py, the generator of the reference pages, as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reference", REFERENCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_covers_the_code() -> None:
    """The reference pages' generators name every command, every route, every job field
    and every setting."""
    from hsx.cli import build_parser
    from hsx.spec import JobSpec
    from hsx_service.config import Settings

    reference = _reference()
    cli = reference.cli()
    commands = [name for action in build_parser()._actions
                if isinstance(action, argparse._SubParsersAction) for name in action.choices]
    assert commands and all(f"### `hsx {name}`" in cli for name in commands)
    schema = reference.job_schema()
    assert all(f"| `{field}` |" in schema for field in JobSpec.model_fields)
    api = reference.openapi()
    assert "### `POST /v1/jobs`" in api and "### `GET /v1/jobs/{job_id}`" in api
    settings = reference.settings()
    assert all(f"`HSX_{name.upper()}`" in settings for name in Settings.model_fields)


def test_the_committed_reference_is_what_the_code_generates() -> None:
    """What `make docs` checks first (`scripts/reference.py --check`): every reference
    page in the repository is current, so the web view shows what the site shows; and
    generating them imports neither torch, vllm nor ray."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import importlib.util, sys\n"
         f"s = importlib.util.spec_from_file_location('r', {str(REFERENCE)!r})\n"
         "m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
         "code = m.main(['--check'])\n"
         "print(code, sorted(x for x in ('torch', 'vllm', 'ray') if x in sys.modules))"],
        capture_output=True, text=True, check=False)
    assert done.stdout.strip() == "0 []", done.stdout + done.stderr
    for page in _reference().PAGES:
        assert "<!-- hsx:end " in (ROOT / page).read_text(), page


# -- the draft methods -------------------------------------------------------------------

METHODS_DIR = ROOT / "docs" / "methods"
# The target the methods pages write for: an 8B Llama's decoder layers.
EIGHT_B_LAYERS = 32
SERVE = re.compile(r"vllm serve [^\n]*--speculative-config \\\n\s*'(\{[^']*\})'")


def _train_help() -> str:
    from hsx.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return str(sub.choices["train"].format_help())


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_every_method_is_named_where_users_look(name: str) -> None:
    title = METHODS[name].title
    places = {"README.md": (ROOT / "README.md").read_text(),
              "docs/reference/cli.md": (ROOT / "docs" / "reference" / "cli.md").read_text(),
              "docs/methods/README.md": (METHODS_DIR / "README.md").read_text(),
              "hsx train --help": _train_help()}
    missing = [where for where, text in places.items() if name not in text or title not in text]
    assert not missing, f"{name} ({title}) is not named in {missing}"
    assert (METHODS_DIR / f"{name}.md").exists()


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_each_method_page_gives_what_the_code_does(name: str) -> None:
    """Its page: the job file's `layers: [NAME]` and the ids they are for an 8B target,
    `hsx train --method NAME`, `hsx eval-draft`, a `vllm serve` line with the method's
    `method` and default `num_speculative_tokens`, and its figures by a link. The
    README's and the methods index's tables give the same serving values."""
    from hsx.spec import TrainSpec

    page = (METHODS_DIR / f"{name}.md").read_text()
    tokens = TrainSpec(method=name).proposed_tokens
    assert f"layers: [{name}]" in page and str(METHODS[name].layers(EIGHT_B_LAYERS)) in page
    assert re.search(rf"hsx train \S+ --method {name}\b", page) and "hsx eval-draft " in page
    (config,) = [json.loads(c) for c in SERVE.findall(page)]
    assert (config["method"], config["num_speculative_tokens"]) == (name, tokens), config
    assert "benchmarks/README.md#current-figures" in page
    row = f'`"method": "{name}"`, `"num_speculative_tokens": {tokens}`'
    for table in (ROOT / "README.md", METHODS_DIR / "README.md"):
        assert row in table.read_text(), (table, row)
