"""Draft commands: `train` (on an output here, or on a job's output on the coordinator)
and `eval-draft` (the draft's acceptance in vLLM)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hsx.cli.jobs import client_for, remote
from hsx.cli.report import EXIT_FAILED, EXIT_REFUSED, error
from hsx.methods import method_names
from hsx.progress import console


def _train_spec(args: argparse.Namespace) -> Any:
    """TrainSpec from --spec FILE and --set key=value overrides (SpecError when bad)."""
    import yaml

    from hsx.spec import SpecError, parse_train

    fields: dict[str, Any] = {}
    if args.spec:
        try:
            loaded = yaml.safe_load(Path(args.spec).read_text())
        except (OSError, yaml.YAMLError) as err:
            raise SpecError(f"cannot read train spec {args.spec}: {err}") from None
        if not isinstance(loaded, dict):
            raise SpecError(f"{args.spec}: a train spec must be a mapping of fields")
        fields.update(loaded)
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecError(f"--set {item!r}: expected key=value")
        fields[key.strip()] = yaml.safe_load(value)
    if args.method:
        fields["method"] = args.method
    if fields.get("online"):
        raise SpecError("online: an online training is a job's `train:` section (hsx "
                        "extract job.yaml, hsx submit): its engines feed the trainer; `hsx "
                        "train` trains on an output's stored shards")
    fields["follow"] = bool(args.follow)
    return parse_train(fields)


def _is_output(target: str) -> bool:
    """A target names an output (a URI or an existing path), else it is a job id."""
    return "://" in target or Path(target).expanduser().exists()


def _train_line(step: int, epoch: int, loss: float | None, acc: list[float], rate: float,
                wait: float) -> str:
    accs = " ".join(f"{a:.2f}" for a in acc)
    loss_text = "-" if loss is None else f"{loss:.4f}"
    return (f"train: step {step} epoch {epoch} loss {loss_text} acc [{accs}] "
            f"{rate:,.0f} tok/s, waiting on data {wait:.1%}")


def _cmd_train(args: argparse.Namespace) -> int:
    """Train a draft on an output (here) or on a job's output (on the coordinator)."""
    from hsx.spec import SpecError

    try:
        spec = _train_spec(args)
    except SpecError as err:
        return error(str(err), EXIT_REFUSED)
    if _is_output(args.target):
        return _train_local(args.target, spec, args.draft_dir)
    return remote(lambda a: _train_remote(a, spec))(args)


def _plan_line(plan: Any) -> str:
    workers = f" x {plan.workers} workers" if plan.workers > 1 else ""
    return (f"plan: {plan.steps:,} steps of {plan.batch_tokens:,} tokens{workers} "
            f"(packs of {plan.pack_tokens:,}) on {plan.device}, lr {plan.lr:g} "
            f"{plan.lr_schedule}, {plan.passes:.1f} passes over {plan.train_tokens:,} tokens "
            f"of {plan.train_samples:,} samples; {plan.val_samples:,} held out; "
            f"validated checkpoint every {plan.checkpoint_every:,} steps")


def _train_local(target: str, spec: Any, draft_dir: str | None,
                 memory_share: float | None = None) -> int:
    """Train here; `memory_share`: of the GPU's memory, at most (an online trainer
    sharing the GPU with the job's engine)."""
    from hsx.draft import draft_folder
    from hsx.output import Output, StorageError
    from hsx.output.layout import DRAFT_DIR
    from hsx_workers.trainer import ShareTooSmall, TrainRefused

    out = console()
    try:
        output = Output(target)
        if not spec.follow and not output.is_complete():
            return error(f"{target}: the extraction is not complete; pass --follow to train "
                          "while it runs", EXIT_REFUSED)
        root = draft_folder(output, draft_dir)
    except (StorageError, ValueError) as err:
        return error(str(err), EXIT_REFUSED)
    try:
        if spec.workers == 1:
            summary = _train_here(output, root, spec, out, memory_share)
        else:
            summary = _train_workers(output, root, spec, out)
    except TrainRefused as err:
        return error(str(err), EXIT_REFUSED)
    except ShareTooSmall as err:
        return error(str(err), EXIT_FAILED)
    except StorageError as err:
        return error(f"{err}; the next `hsx train` resumes from the newest checkpoint",
                      EXIT_FAILED)
    except KeyboardInterrupt:
        return error("interrupted; the next `hsx train` resumes from the newest checkpoint",
                      130)
    resumed = "" if summary.get("resumed_from") is None else \
        f" (resumed from step {summary['resumed_from']})"
    best = summary.get("best") or {}
    chosen = (f"; draft/ holds step {best['step']}, expected acceptance length "
              f"{best['expected_acceptance_length']:.2f} on held-out samples") if best else ""
    into = f"{output.url(DRAFT_DIR)} (trained in {root / DRAFT_DIR})" \
        if output.local_root is None else str(root / DRAFT_DIR)
    out.print(f"[green]trained[/] {summary['step']} steps, {summary['epoch']} epochs{resumed} "
              f"-> {into}{chosen}")
    again = "" if draft_dir is None else f" --draft-dir {draft_dir}"
    out.print(f"measure with: hsx eval-draft {output}{again}", markup=False, highlight=False)
    serving = spec.draft.speculative_config(str(root / DRAFT_DIR), spec.proposed_tokens)
    out.print(f"serve with: vllm serve {output.manifest().model} --speculative-config "
              f"'{json.dumps(serving)}'", markup=False, highlight=False)
    return 0


def _train_here(output: Any, root: Path, spec: Any, out: Any,
                memory_share: float | None = None) -> dict[str, Any]:
    """One process: DraftTrainer, each step printed."""
    from hsx_workers.trainer import DraftTrainer

    def on_plan(plan: Any) -> None:
        out.print(_plan_line(plan), markup=False, highlight=False)
        if plan.online:
            out.print(plan.online, markup=False, highlight=False)
        if plan.warning:
            out.print(f"[yellow]warning:[/] {plan.warning}")

    trainer = DraftTrainer(output, spec, draft_root=root, on_plan=on_plan,
                           memory_share=memory_share,
                           on_metrics=lambda m: out.print(
                               _train_line(m.step, m.epoch, m.loss, m.acc, m.tokens_per_s,
                                           m.wait_fraction),
                               markup=False, highlight=False))
    state = trainer.run()
    return {"step": state.step, "epoch": state.epoch, "resumed_from": trainer.resumed_from,
            "best": trainer.best}


def _train_workers(output: Any, root: Path, spec: Any, out: Any) -> dict[str, Any]:
    """`spec.workers` Ray Train workers on a local (or RAY_ADDRESS's) Ray; the main
    worker's step records are printed as they are written."""
    import threading
    import time

    from hsx.draft import read_jsonl, read_train_state
    from hsx.output.layout import DRAFT_METRICS
    from hsx_service.engine_pool import ensure_ray
    from hsx_workers.trainer import train_distributed

    ensure_ray(None, cpus_needed=spec.workers + 1)
    started = time.time()
    done = threading.Event()

    def show() -> None:
        printed, shown_plan = 0, False
        while not done.wait(1.0):
            state = read_train_state(root) or {}
            if not shown_plan and state.get("plan") and float(state.get("time", 0)) >= started:
                shown_plan = True
                plan = argparse.Namespace(**state["plan"])
                out.print(_plan_line(plan), markup=False, highlight=False)
                if plan.warning:
                    out.print(f"[yellow]warning:[/] {plan.warning}")
            rows = [r for r in read_jsonl(root / DRAFT_METRICS) if r.get("time", 0) >= started]
            for m in rows[printed:]:
                out.print(_train_line(m["step"], m["epoch"], m["loss"], m["acc"],
                                      m["tokens_per_s"], m["wait_fraction"]),
                          markup=False, highlight=False)
            printed = len(rows)

    printer = threading.Thread(target=show, name="hsx-train-print", daemon=True)
    printer.start()
    try:
        return train_distributed(output, spec, draft_root=root)
    finally:
        done.set()
        printer.join(timeout=5)


def _train_remote(args: argparse.Namespace, spec: Any) -> int:
    client = client_for(args)
    status = client.train(args.target, spec)
    if args.detach:
        sys.stdout.write(f"training {args.target}: {status.state.value} -> {status.draft}\n")
        return 0
    last_step = -1

    def show(s: Any) -> None:
        nonlocal last_step
        if s.step != last_step:
            last_step = s.step
            console().print(_train_line(s.step, s.epoch, s.loss, s.acc, s.tokens_per_s,
                                        s.wait_fraction), markup=False, highlight=False)

    final = client.wait_train(args.target, on_update=show)
    if final.state.value != "done":
        return error(f"training of {args.target} {final.state.value}: {final.error}",
                      EXIT_FAILED)
    console().print(f"[green]trained[/] {final.step} steps -> {final.draft}")
    if final.best_step is not None and final.best_expected_acceptance_length is not None:
        console().print(f"draft/ holds step {final.best_step}, expected acceptance length "
                        f"{final.best_expected_acceptance_length:.2f} on held-out samples")
    if final.eval is not None:
        console().print(
            f"vLLM: {final.eval.error}" if final.eval.error else
            f"vLLM: mean acceptance length {final.eval.mean_acceptance_length:.2f} at "
            f"k={final.eval.k} on {final.eval.prompts} held-out prompts",
            markup=False, highlight=False)
    return 0


def train_after_extraction(job: Any, output: str) -> int:
    """A job file's `train:` run by `hsx extract`: the draft trained here on the finished
    output (the extraction's engines are gone by then, so a one-GPU machine trains on
    the GPU they used), then measured by vLLM as the coordinator measures it: the target
    loaded as the job loads it, on `eval_prompts` held-out prompts (draft/eval.json)."""
    spec = job.train.model_copy(update={"follow": False})
    code = _train_local(output, spec, None)
    if code != 0 or spec.eval_prompts == 0:
        return code
    return _measure_draft(job, output)


def train_online(job: Any, extract: Callable[[], int]) -> int:
    """`hsx extract` of a job with `train: {online: true}`: the trainer runs here on a
    thread while `extract()` drives the engines, which capture for it through the job's
    stream (hsx.online) until it has trained its steps; then vLLM measures the draft."""
    import threading

    from hsx.online import Stream
    from hsx.output import Output
    from hsx_service.engine_pool import connect_ray
    from hsx_service.errors import JobRefused
    from hsx_service.placement import plan_for_cluster
    from hsx_service.scheduler import check_draft_layers

    try:
        check_draft_layers(job)  # before any engine starts
        connect_ray(job)
        # On a GPU the engines take, the trainer takes its plan's share of one of them.
        share = plan_for_cluster(job).train_share or None
    except JobRefused as err:
        return error(str(err), EXIT_REFUSED)
    stream = Stream(Output(job.output).location)
    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            outcome["code"] = _train_local(job.output, job.train, None, share)
        except BaseException as err:  # the engines must hear of it, whatever it is
            outcome["code"] = EXIT_FAILED
            outcome["error"] = f"{type(err).__name__}: {err}"
            raise
        finally:
            if outcome.get("code") != 0:  # else the trainer said `done` itself
                stream.set_trainer("failed", error=outcome.get(
                    "error", f"the trainer exited with code {outcome.get('code')}"))

    trainer = threading.Thread(target=train, name="hsx-online-trainer", daemon=True)
    trainer.start()
    code = extract()
    if code != 0:
        return code
    trainer.join()
    if outcome.get("code") != 0 or job.train.eval_prompts == 0:
        return int(outcome.get("code", EXIT_FAILED))
    return _measure_draft(job, job.output)


def _measure_draft(job: Any, output: str) -> int:
    """vLLM measures the job's trained draft as the coordinator would (draft/eval.json)."""
    spec = job.train
    from hsx.draft import draft_folder
    from hsx.output import Output, StorageError
    from hsx_service.engine_config import target_engine_args
    from hsx_workers.acceptance import evaluate_draft

    _release_training_memory()
    trained = Output(output)
    try:
        result = evaluate_draft(trained, prompts=spec.eval_prompts,
                                max_tokens=spec.eval_max_tokens, k=spec.proposed_tokens,
                                engine=target_engine_args(job))
    except (StorageError, ValueError, FileNotFoundError) as err:
        return error(f"the draft was trained but could not be measured: {err}; "
                     f"run `hsx eval-draft {output}` to measure it", EXIT_FAILED)
    _print_eval(result, _eval_path(trained, draft_folder(trained, None)))
    return 0


def _release_training_memory() -> None:
    """What the trainer left cached on the GPU goes back before vLLM sizes its cache."""
    import gc

    gc.collect()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _eval_path(output: Any, root: Path) -> str:
    """Where draft/eval.json was recorded: the bucket's, or the draft folder's."""
    from hsx.output.layout import DRAFT_EVAL

    return output.url(DRAFT_EVAL) if output.local_root is None else str(root / DRAFT_EVAL)


def _print_eval(result: dict[str, Any], recorded_in: str | None) -> None:
    rates = " ".join(f"{r:.2f}" for r in result["acceptance_per_position"])
    interval = result.get("confidence_interval")
    within = f" (95% interval {interval[0]:.2f}-{interval[1]:.2f})" if interval else ""
    ended = result.get("stopped_at_eos")
    ending = f", {ended} of them ending their turn" if ended is not None else ""
    console().print(
        f"mean acceptance length {result['mean_acceptance_length']:.2f}{within} at "
        f"k={result['k']} on {result['prompts']} {result['prompt_source']}{ending} "
        f"({result['accepted_tokens']} of {result['draft_tokens']} draft tokens accepted "
        f"in {result['drafts']} drafts; acceptance per position [{rates}])",
        markup=False, highlight=False)
    if recorded_in is not None:
        console().print(f"recorded in {recorded_in}", markup=False, highlight=False)


def _cmd_eval_draft(args: argparse.Namespace) -> int:
    """Generate with vLLM and the draft on held-out prompts; report vLLM's acceptance
    counters and record them in draft/eval.json."""
    from hsx.draft import draft_folder
    from hsx.export import draft_aux_count_unread
    from hsx.output import Output, StorageError
    from hsx_workers.acceptance import evaluate_draft

    try:
        engine: dict[str, Any] = {}
        if args.job:  # the target as the job's engines load it: TP, dtype, its vllm: ones
            from hsx.spec import load_job
            from hsx_service.engine_config import target_engine_args

            engine = target_engine_args(load_job(args.job))
        if args.tensor_parallel_size:
            engine["tensor_parallel_size"] = args.tensor_parallel_size
        if args.draft is not None and draft_aux_count_unread(args.draft):
            return error(f"vLLM would read a wrong auxiliary layer count from {args.draft}; "
                         f"run `hsx fix-draft {args.draft}` first", EXIT_REFUSED)
        output = Output(args.output)
        root = draft_folder(output, args.draft_dir) if args.draft is None else None
        result = evaluate_draft(output, draft_root=args.draft_dir, prompts=args.prompts,
                                max_tokens=args.max_tokens, k=args.k, prefix=args.prefix,
                                draft=args.draft, target=args.target, engine=engine or None)
    except (StorageError, ValueError, FileNotFoundError) as err:
        return error(str(err), EXIT_REFUSED)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        return 0
    # Another draft than the output's (--draft) is measured, not recorded.
    _print_eval(result, None if root is None else _eval_path(output, root))
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "train", help="train a draft (EAGLE-3, DFlash, ...) on an output (a path) or a job "
                      "(an id)")
    p.add_argument("target", help="an output path or URI (file://, s3://: trains here), or a "
                                  "job id (the coordinator trains it)")
    p.add_argument("--follow", action="store_true",
                   help="start on the shards committed so far and keep up with the extraction")
    p.add_argument("--method", choices=method_names(),
                   help="draft method (default eagle3; the spec's when it names one)")
    p.add_argument("--spec", help="TrainSpec file (YAML or JSON)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one TrainSpec field, e.g. --set epochs=3 (repeatable)")
    p.add_argument("--detach", action="store_true",
                   help="job id only: start the training and return at once")
    p.add_argument("--draft-dir", help="output only: the local folder to train the draft "
                                       "in (default the output's; for s3:// a folder in "
                                       "$HSX_CACHE, ~/.cache/hsx, uploaded to the bucket)")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "eval-draft", help="acceptance of an output's trained draft in vLLM (greedy, the "
                           "draft's method)")
    p.add_argument("output", help="the output the draft was trained on (prompts come from it)")
    p.add_argument("--draft-dir", help="the local folder the draft was trained in (as "
                                       "`hsx train --draft-dir`; default the output's; for "
                                       "s3:// the bucket's draft is downloaded there)")
    p.add_argument("--draft", help="draft folder (default: <draft-dir>/draft; another one is "
                                   "measured but not recorded)")
    p.add_argument("--target", help="target model (default: the output's model)")
    p.add_argument("--job", help="the job file that made the output: vLLM loads the target "
                                 "as its engines did (tensor_parallel_size, dtype, its "
                                 "`vllm:` engine arguments), as the coordinator's evaluation "
                                 "does")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="GPUs the target spans (default: the job's, else 1)")
    p.add_argument("--k", type=int, default=None,
                   help="num_speculative_tokens (default: what the training's draft proposes: "
                        "EAGLE-3's ttt_steps, 3; a DFlash block less its anchor, 7; "
                        "P-EAGLE's block, 8)")
    p.add_argument("--prompts", type=int, default=None,
                   help="held-out samples whose prompts vLLM answers (default: the "
                        "training's `eval_prompts`, 256; as many as are held out)")
    p.add_argument("--prefix", type=int, default=8,
                   help="prompt length for samples without a question (all loss-masked)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="at most this many tokens per answer; each stops at the end of "
                        "its turn or at its answer's length in the dataset (default: the "
                        "training's `eval_max_tokens`, 256)")
    p.add_argument("--json", action="store_true", help="the counters as JSON on stdout")
    p.set_defaults(func=_cmd_eval_draft)
