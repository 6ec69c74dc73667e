"""The reference pages, generated from the code and committed: `make reference` writes
them, `make docs` (and so `make test`) fails when a committed page differs from what the
code generates, as a lockfile is checked. The repository's web view and the docs site
therefore show the same, complete pages.

A page holds each generated part between `<!-- hsx:generated NAME -->` and
`<!-- hsx:end NAME -->`; the text around it is written by hand. The generators:
`job-schema` from `JobSpec.model_json_schema()`, `cli` from the argparse tree of
`hsx.cli.build_parser()`, `openapi` from the coordinator's FastAPI app (built without a
scheduler: no Ray, no engine), `settings` from its `Settings` (the `HSX_*` variables),
`python-api` from `hsx`'s docstrings.

    python scripts/reference.py           # write the pages (make reference)
    python scripts/reference.py --check   # exit 1 naming each stale page (make docs)

Nothing here imports torch, vllm or ray. The output does not depend on the terminal or
on `HSX_*` variables set where it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The pages holding generated parts.
PAGES = ("docs/reference/cli.md", "docs/reference/api.md", "docs/reference/job-schema.md",
         "docs/reference/python.md", "docs/guides/operations.md")
PART = re.compile(r"(<!-- hsx:generated ([\w-]+) -->\n)(.*?)(<!-- hsx:end \2 -->)", re.S)
# argparse wraps usage lines at the terminal's width: one width wherever it runs.
WIDTH = "100"


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
    if parser.epilog:
        lines += ["", "```text", parser.epilog.strip(), "```"]
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


GENERATORS: dict[str, Callable[[], str]] = {
    "job-schema": job_schema, "cli": cli, "openapi": openapi, "python-api": python_api,
    "settings": settings}


def generated(text: str) -> str:
    """`text` with each generated part as the code generates it now."""
    return PART.sub(lambda m: f"{m.group(1)}\n{GENERATORS[m.group(2)]().strip()}\n\n"
                              f"{m.group(4)}", text)


def _stable_environment() -> None:
    os.environ["COLUMNS"] = WIDTH
    for name in [n for n in os.environ if n.startswith("HSX_")]:
        del os.environ[name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each page that differs")
    args = parser.parse_args(argv)
    _stable_environment()
    stale = []
    for name in PAGES:
        path = ROOT / name
        text = path.read_text()
        if not PART.search(text):
            raise SystemExit(f"{name}: no `<!-- hsx:generated NAME -->` part")
        new = generated(text)
        if new == text:
            continue
        stale.append(name)
        if not args.check:
            path.write_text(new)
    if args.check and stale:
        sys.stderr.write(f"stale reference pages: {', '.join(stale)}; the code they describe "
                         "changed. Run `make reference` and commit them.\n")
        return 1
    for name in stale:
        sys.stdout.write(f"wrote {name}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
