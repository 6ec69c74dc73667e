"""The `HSX_*` settings: one registry (hsx.settings), and no module reading one past it.

An environment variable read here and there has no one place that says it exists, what
it defaults to, or what it does; the registry is that place, and these tests keep the
code from growing a variable beside it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from hsx import settings
from hsx_service.config import Settings

REPO = Path(__file__).resolve().parents[2]
TREES = ("client", "workers", "service")
REGISTRY = REPO / "client" / "hsx" / "settings.py"
NAME = re.compile(r"\bHSX_[A-Z0-9_]*[A-Z0-9]\b")
# Reads keyed by a variable, not a literal: the AWS_* names of an S3 option (a table),
# the hub's two offline switches (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE).
NON_LITERAL_READS = {"client/hsx/output/s3_multipart.py", "client/hsx/ingest/sources.py"}


def _sources() -> Iterator[tuple[str, ast.Module]]:
    for tree in TREES:
        for path in sorted((REPO / tree).rglob("*.py")):
            if path != REGISTRY:
                yield str(path.relative_to(REPO)), ast.parse(path.read_text(), str(path))


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _environ_keys(module: ast.Module) -> Iterator[ast.expr]:
    """The key of every read of the environment: os.environ.get(k), os.environ[k],
    os.getenv(k), `k in os.environ`, os.environ.setdefault(k, ...)."""
    for node in ast.walk(module):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if (func.attr in ("get", "setdefault", "pop") and _is_environ(func.value)) or (
                    func.attr == "getenv"):
                yield node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            yield node.slice
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            yield node.left


def _through_the_registry(key: ast.expr) -> bool:
    """`settings.X.name` (or `hsx_settings.X.name`): a registered name, to set for a child."""
    return (isinstance(key, ast.Attribute) and key.attr == "name"
            and isinstance(key.value, ast.Attribute) and isinstance(key.value.value, ast.Name)
            and key.value.value.id.endswith("settings") and key.value.attr in vars(settings))


def test_no_module_reads_an_hsx_variable_past_the_registry() -> None:
    """Every read of the environment outside hsx/settings.py names a literal variable
    that is not `HSX_*` (HF_HUB_OFFLINE, RAY_ADDRESS, VLLM_*): an `HSX_*` one is read
    with `settings.<NAME>.get()`. A key that is not a literal could be one, so it fails
    too, except where listed in NON_LITERAL_READS."""
    found: list[str] = []
    for where, module in _sources():
        for key in _environ_keys(module):
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                if key.value.startswith("HSX_"):
                    found.append(f"{where}:{key.lineno}: {key.value}")
            elif not _through_the_registry(key) and where not in NON_LITERAL_READS:
                found.append(f"{where}:{key.lineno}: {ast.unparse(key)}")
    assert not found, ("read the environment past hsx.settings (register the variable "
                       "there and read it with settings.<NAME>.get()):\n" + "\n".join(found))


def test_every_hsx_name_in_the_code_is_a_setting() -> None:
    """Every `HSX_*` name a message, a help text or a docstring mentions is a registered
    setting or a field of the coordinator's Settings: none is stale or misspelled."""
    known = set(settings.SETTINGS) | {f"HSX_{name.upper()}" for name in Settings.model_fields}
    unknown: list[str] = []
    for where, module in _sources():
        for node in ast.walk(module):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                unknown += [f"{where}:{node.lineno}: {name}"
                            for name in NAME.findall(node.value) if name not in known]
    assert not unknown, "\n".join(unknown)


@pytest.mark.parametrize("name", sorted(settings.SETTINGS))
def test_each_setting_says_what_it_is_and_reads_back(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Documented (a sentence), typed, with a default; unset and empty mean the default."""
    setting = settings.SETTINGS[name]
    assert setting.doc.endswith(".") and len(setting.doc) > 40, name
    assert setting.kind
    monkeypatch.delenv(name, raising=False)
    assert setting.get() == setting.default == settings.get(name)
    monkeypatch.setenv(name, "  ")
    assert setting.get() == setting.default


def test_values_parse_and_a_bad_one_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSX_QUOTA_BYTES", "1e9")
    assert settings.QUOTA_BYTES.get() == 10**9
    monkeypatch.setenv("HSX_QUOTA_BYTES", "0")
    assert settings.QUOTA_BYTES.get() is None
    monkeypatch.setenv("HSX_OUTPUT_MODE", "0640")
    assert settings.OUTPUT_MODE.get() == 0o640
    monkeypatch.setenv("HSX_DIRECT_IO", "1")
    assert settings.DIRECT_IO.get() is True
    monkeypatch.setenv("HSX_CACHE", "~/cache")
    assert settings.CACHE.get() == Path("~/cache").expanduser()
    for name, bad in (("HSX_QUOTA_BYTES", "lots"), ("HSX_OUTPUT_MODE", "0755"),
                      ("HSX_DIRECT_IO", "maybe"), ("HSX_INGEST_WORKERS", "-1"),
                      ("HSX_TEMPLATE_SECONDS", "inf")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"^{name}='{re.escape(bad)}' "):
            settings.get(name)
    with pytest.raises(KeyError, match="HSX_NOPE is not an hsx setting"):
        settings.get("HSX_NOPE")
