"""mkdocs hooks: the site is the repository as GitHub shows it, plus generated reference.

- `on_files`: the pages are the repository's own files at their own paths (README.md is
  the home page, docs/FORMAT.md stays docs/FORMAT.md, benchmarks/results/... are there),
  so a relative link means the same on GitHub and on the site, and `mkdocs build
  --strict` checks every link and anchor of every document, results folders included.
  Source files, job files and results that documents link to are copied as they are.
- `on_page_markdown`: a page holding `<!-- hsx:generated NAME -->` gets that reference
  generated from the code it describes: `job-schema` from `JobSpec.model_json_schema()`,
  `cli` from the argparse tree of `hsx.cli.build_parser()`, `openapi` from the
  coordinator's FastAPI app (built without a scheduler: no Ray, no engine), `settings`
  from its `Settings` (the `HSX_*` variables), `python-api` from `hsx`'s docstrings.

Nothing here imports torch, vllm or ray.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- hsx:generated ([\w-]+) -->")
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


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)


# -- the job file's schema ------------------------------------------------------------

def job_schema() -> str:
    from hsx.spec import JobSpec

    schema = JobSpec.model_json_schema()
    defs = schema.get("$defs", {})
    parts = [_model_table("JobSpec", schema, defs)]
    for name in sorted(defs):
        if "properties" in defs[name]:
            parts.append(_model_table(name, defs[name], defs))
    return "\n\n".join(parts)


def _model_table(name: str, model: dict[str, Any], defs: dict[str, Any]) -> str:
    lines = [f"### {name}", ""]
    if model.get("description"):
        lines += [" ".join(model["description"].split()), ""]
    required = set(model.get("required", []))
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for field, prop in model.get("properties", {}).items():
        default = "required" if field in required else _cell(json.dumps(prop.get("default")))
        lines.append(f"| `{field}` | {_type(prop)} | {default} | "
                     f"{_cell(prop.get('description', ''))} |")
    if model.get("additionalProperties") not in (False, None):
        lines += ["", "Other keys are allowed (see the description above)."]
    return "\n".join(lines)


def _type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']}`"
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return " or ".join(_type(p) for p in prop[key])
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}))}"
    if kind == "object" and "additionalProperties" in prop:
        value = prop["additionalProperties"]
        return f"map to {_type(value) if isinstance(value, dict) else 'any'}"
    return str(kind)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


# -- the CLI -----------------------------------------------------------------------------

def cli() -> str:
    from hsx.cli import build_parser

    parser = build_parser()
    parts = [_parser_section("hsx", parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                parts.append(_parser_section(f"hsx {name}", sub, helps.get(name)))
    return "\n\n".join(parts)


def _parser_section(title: str, parser: argparse.ArgumentParser, summary: str | None = None
                    ) -> str:
    lines = [f"### `{title}`", ""]
    if summary or parser.description:
        lines += [_cell(summary or parser.description or ""), ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(action.option_strings) or action.dest
        metavar = action.metavar or (action.dest.upper() if action.option_strings
                                     and action.nargs != 0 else "")
        default = ("" if action.default in (None, argparse.SUPPRESS, False)
                   or not action.option_strings or "default" in (action.help or "")
                   else f" (default `{action.default}`)")
        help_text = (action.help or "") % {"default": action.default} if action.help else ""
        choices = f" One of: {', '.join(map(str, action.choices))}." if action.choices else ""
        rows.append(f"| `{name}{' ' + str(metavar) if metavar else ''}` | "
                    f"{_cell(help_text)}{choices}{default} |")
    if rows:
        lines += ["| argument | |", "|---|---|", *rows]
    return "\n".join(lines)


# -- the coordinator's REST API ------------------------------------------------------------

def openapi() -> str:
    from hsx_service.config import Settings
    from hsx_service.main import create_app

    spec = create_app(Settings()).openapi()
    lines = [f"API version {spec['info']['version']}.", ""]
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            lines += [f"### `{method.upper()} {path}`", ""]
            if op.get("summary"):
                lines += [f"**{op['summary']}.**", ""]
            if op.get("description"):
                lines += [" ".join(op["description"].split()), ""]
            params = op.get("parameters", [])
            if params:
                lines += ["| parameter | in | type | |", "|---|---|---|---|"]
                for p in params:
                    lines.append(f"| `{p['name']}` | {p['in']} | "
                                 f"{_type(p.get('schema', {})).replace('#', '#schema-')} | "
                                 f"{_cell(p.get('description', ''))} |")
                lines.append("")
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body:
                lines += [f"Body: {_schema_link(body.get('schema', {}))}", ""]
            lines += ["| answer | meaning | body |", "|---|---|---|"]
            for code, answer in sorted(op.get("responses", {}).items()):
                content = answer.get("content", {}).get("application/json")
                body_link = _schema_link(content["schema"]) if content else ""
                lines.append(f"| {code} | {_cell(answer.get('description', ''))} | {body_link} |")
            lines.append("")
    lines += ["## Schemas", ""]
    for name, schema in sorted(spec.get("components", {}).get("schemas", {}).items()):
        table = _model_table(name, schema, {})
        lines += [table.replace("### ", "### Schema ", 1).replace("](#", "](#schema-"), ""]
    return "\n".join(lines)


def _schema_link(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#schema-{name.lower()})"
    return _type(schema)


# -- the Python API ---------------------------------------------------------------------

def python_api() -> str:
    import inspect

    import hsx

    parts = []
    for name in ("HiddenStatesDataset", "Client", "load_job"):
        obj = getattr(hsx, name)
        parts += [f"### `hsx.{name}`", "", "```python",
                  f"{name}{_signature(obj)}", "```", "", inspect.getdoc(obj) or "", ""]
        if not inspect.isclass(obj):
            continue
        for member, value in vars(obj).items():
            if member.startswith("_") or not (callable(value) or isinstance(value, property)):
                continue
            target = value.fget if isinstance(value, property) else value
            signature = "" if isinstance(value, property) else _signature(target)
            parts += [f"#### `{name}.{member}`", "", "```python",
                      f"{member}{signature}", "```", "", inspect.getdoc(target) or "", ""]
    return "\n".join(parts)


def _signature(obj: Any) -> str:
    import inspect

    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


# -- the coordinator's settings ------------------------------------------------------------

def settings() -> str:
    from hsx_service.config import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    lines = ["| variable | default | |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = "" if field.is_required() or field.default_factory else field.default
        shown = "unset" if default is None else f"`{default}`" if default != "" else ""
        lines.append(f"| `{prefix}{name.upper()}` | {shown} | {_cell(field.description or '')} |")
    return "\n".join(lines)


GENERATORS = {"job-schema": job_schema, "cli": cli, "openapi": openapi,
              "python-api": python_api, "settings": settings}
