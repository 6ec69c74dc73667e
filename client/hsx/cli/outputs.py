"""Commands on an output (a directory, file:// or s3:// URI): `export` writes it in
speculators' or SpecForge's layout (`fix-draft` readies what speculators trains on it for
vLLM),
`verify` checks every committed shard (and withdraws bad ones)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hsx.cli.report import EXIT_FAILED, EXIT_REFUSED, error
from hsx.export import FORMATS, SPECULATORS_FORMAT
from hsx.methods import method_names
from hsx.progress import console


def _cmd_export(args: argparse.Namespace) -> int:
    """Write an hsx output in another tool's offline-data layout (speculators', SpecForge's)."""
    from hsx.export import SPECFORGE_FORMAT, ExportError, export_output

    try:
        summary = export_output(
            args.uri, args.dest, fmt=args.format, force=args.force,
            allow_incomplete=args.allow_incomplete, method=args.method, model=args.model,
        )
    except ExportError as err:
        return error(str(err), EXIT_REFUSED)
    except KeyboardInterrupt:
        return error("interrupted; nothing was written to the destination", 130)
    if args.json:
        sys.stdout.write(json.dumps(summary.as_dict()) + "\n")
        return 0
    console().print(
        f"[green]exported[/] {summary.samples} samples, {summary.tokens:,} tokens, "
        f"{summary.bytes / 2**20:,.1f} MiB of hidden states in {summary.seconds:.1f}s "
        f"-> {summary.dest}"
    )
    if summary.not_exported:
        console().print(f"{summary.not_exported} samples have no hidden states "
                        "(see `hsx errors` / HiddenStatesDataset.errors()); not exported")
    if not summary.source_complete:
        console().print("[yellow]the source job was not complete: later shards are missing[/]")
    if summary.format == SPECFORGE_FORMAT:
        console().print(f"train with: {summary.specforge_hint()}", markup=False,
                        highlight=False)
        return 0
    console().print(f"train with: {summary.train_command()}", markup=False, highlight=False)
    console().print(f"then, before vLLM loads the draft: {summary.fix_command()}",
                    markup=False, highlight=False)
    return 0


def _cmd_fix_draft(args: argparse.Namespace) -> int:
    """Record a speculators-trained draft's auxiliary layer count where vLLM reads it."""
    from hsx.export import fix_speculators_draft

    changed = fix_speculators_draft(args.path)
    for path in changed:
        sys.stdout.write(f"{path}\n")
    console().print(f"{len(changed)} draft config(s) changed under {args.path}"
                    if changed else f"nothing to change under {args.path}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    """Check every committed shard of an output; with --repair withdraw the bad ones."""
    from hsx.output import Output, OutputCorrupt, OutputNotFound, StorageError

    output = Output(args.uri)
    try:
        manifest = output.manifest()
        units = output.committed_units()
        with console().status(f"verifying {len(units)} committed shards of {output}") as st:
            checked = 0

            def tick(unit: int) -> None:
                nonlocal checked
                checked += 1
                st.update(f"verifying shards of {output}: {checked}/{len(units)}")

            bad = output.check_shards(on_checked=tick)
    except (OutputNotFound, OutputCorrupt, StorageError) as err:
        return error(str(err), EXIT_REFUSED)
    withdrawn = output.withdraw([b.unit for b in bad]) if args.repair and bad else []
    if args.json:
        sys.stdout.write(json.dumps({
            "output": str(output), "units_total": len(manifest.units), "committed": len(units),
            "bad": [{"unit": b.unit, "shard": b.shard, "reason": b.reason} for b in bad],
            "withdrawn": withdrawn,
        }) + "\n")
    else:
        for b in bad:  # one line each, tab-separated: for grep and cut
            sys.stdout.write(f"unit {b.unit}\t{b.shard}\t{b.reason}\n")
        if not bad:
            console().print(f"[green]ok[/]: {len(units)} committed shards of {output} "
                            "match their checksums")
        elif withdrawn:
            console().print(f"[yellow]withdrawn[/] {len(withdrawn)} bad shard(s) (units "
                            f"{withdrawn}); run the job again to extract them")
        else:
            console().print(f"[bold red]{len(bad)} of {len(units)} committed shards are bad[/]; "
                            "`hsx verify --repair` withdraws them so that a rerun of the "
                            "job extracts those units again")
    return EXIT_FAILED if bad else 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("export", help="write an output in speculators' or SpecForge's "
                       "offline-data layout")
    p.add_argument("uri", help="the hsx output (directory, file:// or s3:// URI)")
    p.add_argument("dest", help="directory to create (must be absent or empty)")
    p.add_argument("--format", choices=FORMATS, default=SPECULATORS_FORMAT,
                   help="target layout (default speculators)")
    p.add_argument("--method", choices=method_names(),
                   help="only the layers a draft of this method reads (and N), for an output "
                        "captured for several methods (default: every stored layer; "
                        "eagle3 for specforge, whose layout is per method)")
    p.add_argument("--model", help="a local copy of the target, for the final norm of "
                   "SpecForge's post-norm states (default: the output's model)")
    p.add_argument("--force", action="store_true", help="replace an earlier hsx export at DEST")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="export what a still-running job has committed so far")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("fix-draft", help="make the EAGLE-3 drafts speculators saved under "
                       "PATH load in vLLM with their own number of auxiliary layers")
    p.add_argument("path", help="speculators' --save-path (every config.json under it)")
    p.set_defaults(func=_cmd_fix_draft)

    p = sub.add_parser("verify", help="check every committed shard's checksums; "
                       "--repair withdraws the bad ones so a rerun extracts them again")
    p.add_argument("uri", help="the hsx output (directory, file:// or s3:// URI)")
    p.add_argument("--repair", action="store_true",
                   help="withdraw the commits of bad shards and remove them (no job may run "
                   "on the output meanwhile)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=_cmd_verify)
