"""mkdocs hook: the site is the repository as GitHub shows it.

The pages are the repository's own files at their own paths (README.md is the home
page, docs/FORMAT.md stays docs/FORMAT.md, benchmarks/results/... are there), so a
relative link means the same on GitHub and on the site, and `mkdocs build --strict`
checks every link and anchor of every document, results folders included. Source files,
job files and results that documents link to are copied as they are.

The reference pages are committed as they are (scripts/reference.py generates them);
the site shows them unchanged.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
# Never part of the site: build outputs, caches, and files of the tests' fixtures.
SKIP = re.compile(r"(^|/)(\.[^/]+|site|__pycache__|node_modules|demo-output)(/|$)")


def _tracked() -> list[str]:
    """The repository's files, as git lists them (tracked and not ignored)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, text=True, check=True).stdout
        names = out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()]
    return sorted(n for n in names if not SKIP.search(n) and (ROOT / n).is_file())


def on_files(files: Files, config: MkDocsConfig) -> Files:
    docs_dir = Path(config.docs_dir).resolve()
    # The theme's own files (CSS, JavaScript, fonts) stay; docs_dir's are replaced by the
    # repository's, docs_dir's among them at their repository paths.
    site = Files([f for f in files if f.abs_src_path is None
                  or docs_dir not in Path(f.abs_src_path).resolve().parents])
    taken = {f.dest_uri for f in site}
    for name in _tracked():
        file = File(name, str(ROOT), config.site_dir, config.use_directory_urls)
        if file.dest_uri not in taken:
            site.append(file)
    return site
