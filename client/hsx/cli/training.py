"""Draft commands: `train` (on an output here, or on a job's output on the coordinator)
and `eval-draft` (the draft's acceptance in vLLM)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hsx.cli.jobs import client_for, remote
from hsx.cli.report import EXIT_FAILED, EXIT_REFUSED, error
from hsx.methods import all_methods, method_names
from hsx.progress import console


def _train_spec(args: argparse.Namespace) -> Any:
    """TrainSpec from --spec FILE and --set key=value overrides (SpecError when bad)."""
    import yaml

    from hsx.spec import SpecError, apply_sets, parse_train

    fields: dict[str, Any] = {}
    if args.spec:
        try:
            loaded = yaml.safe_load(Path(args.spec).read_text())
        except (OSError, yaml.YAMLError) as err:
            raise SpecError(f"cannot read train spec {args.spec}: {err}") from None
        if not isinstance(loaded, dict):
            raise SpecError(f"{args.spec}: a train spec must be a mapping of fields")
        fields.update(loaded)
    fields = apply_sets(fields, args.set or [])
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
        return _train_output(args.target, spec, args.draft_dir,
                             trust_remote_code=args.trust_remote_code)
    return remote(lambda a: _train_remote(a, spec))(args)


def _plan_line(plan: Any) -> str:
    workers = f" x {plan.workers} workers" if plan.workers > 1 else ""
    return (f"plan: {plan.steps:,} steps of {plan.batch_tokens:,} tokens{workers} "
            f"(packs of {plan.pack_tokens:,}) on {plan.device}, lr {plan.lr:g} "
            f"{plan.lr_schedule}, {plan.passes:.1f} passes over {plan.train_tokens:,} tokens "
            f"of {plan.train_samples:,} samples; {plan.val_samples:,} held out; "
            f"validated checkpoint every {plan.checkpoint_every:,} steps")


def _train_output(target: str, spec: Any, draft_dir: str | None, *,
                  trust_remote_code: bool = False) -> int:
    """`hsx train OUTPUT`: the one training run (hsx_service.training) in this process,
    each step printed; no job, so no measurement by vLLM (it says how to measure).
    The target is the model the output's manifest names, its own code run only with
    `trust_remote_code` (the person's word, never the manifest's)."""
    from hsx.draft import draft_folder
    from hsx.output import Output, StorageError
    from hsx.output.layout import DRAFT_DIR
    from hsx.spec import TargetModel
    from hsx_service.training import TrainingRequest, TrainingRun

    out = console()
    try:
        output = Output(target)
        if not spec.follow and not output.is_complete():
            return error(f"{target}: the extraction is not complete; pass --follow to train "
                          "while it runs", EXIT_REFUSED)
        root = draft_folder(output, draft_dir)
        model = TargetModel(output.manifest().model, trust_remote_code=True) \
            if trust_remote_code else None
    except (StorageError, ValueError) as err:
        return error(str(err), EXIT_REFUSED)
    if spec.workers > 1:
        from hsx_service.engine_pool import ensure_ray

        ensure_ray(None, cpus_needed=spec.workers + 1)
    run = TrainingRun(TrainingRequest(output, spec, target=model, draft_root=draft_dir,
                                      here=True), training_hooks())
    try:
        outcome = run.run()
    except KeyboardInterrupt:
        return error("interrupted; the next `hsx train` resumes from the newest checkpoint",
                      130)
    code = _training_failed(outcome, "the next `hsx train` resumes from the newest "
                            "checkpoint")
    if code is not None:
        return code
    _print_trained(outcome, output, root, DRAFT_DIR)
    again = "" if draft_dir is None else f" --draft-dir {draft_dir}"
    out.print(f"measure with: hsx eval-draft {output}{again}", markup=False, highlight=False)
    serving = spec.draft.speculative_config(str(root / DRAFT_DIR), spec.proposed_tokens)
    out.print(f"serve with: vllm serve {output.manifest().model} --speculative-config "
              f"'{json.dumps(serving)}'", markup=False, highlight=False)
    return 0


def training_hooks() -> Any:
    """How a training run in this process reports: its plan, each step, what it waits
    for, vLLM's measurement, printed."""
    from hsx_service.training import TrainingHooks

    out = console()
    waits: list[str | None] = [None]

    def on_plan(plan: dict[str, Any]) -> None:
        shown = argparse.Namespace(**plan)
        out.print(_plan_line(shown), markup=False, highlight=False)
        if plan.get("online"):
            out.print(plan["online"], markup=False, highlight=False)
        if plan.get("warning"):
            out.print(f"[yellow]warning:[/] {plan['warning']}")

    def on_step(m: dict[str, Any]) -> None:
        out.print(_train_line(m["step"], m["epoch"], m["loss"], m["acc"], m["tokens_per_s"],
                              m["wait_fraction"]), markup=False, highlight=False)

    def on_waiting(reason: str | None) -> None:
        if reason is not None and reason != waits[0]:
            out.print(f"train: {reason}", markup=False, highlight=False)
        waits[0] = reason

    return TrainingHooks(on_plan=on_plan, on_step=on_step, on_waiting=on_waiting)


def _training_failed(outcome: Any, resumes: str) -> int | None:
    """The exit code of a training that did not end `done` (and says why), else None."""
    from hsx.output import StorageError
    from hsx.wire import TrainState
    from hsx_workers.trainer import ShareTooSmall

    if outcome.state is TrainState.done:
        return None
    if outcome.state is TrainState.stopped:
        return error(f"the training stopped; {resumes}", 130)
    if outcome.refused:
        return error(str(outcome.exception or outcome.error), EXIT_REFUSED)
    if isinstance(outcome.exception, ShareTooSmall):
        return error(str(outcome.exception), EXIT_FAILED)
    if isinstance(outcome.exception, StorageError):
        return error(f"{outcome.exception}; {resumes}", EXIT_FAILED)
    return error(f"the training failed: {outcome.error}; {resumes}", EXIT_FAILED)


def _print_trained(outcome: Any, output: Any, root: Path, draft_dir: str) -> None:
    summary = outcome.result
    resumed = "" if summary.get("resumed_from") is None else \
        f" (resumed from step {summary['resumed_from']})"
    best = summary.get("best") or {}
    chosen = (f"; draft/ holds step {best['step']}, expected acceptance length "
              f"{best['expected_acceptance_length']:.2f} on held-out samples") if best else ""
    into = f"{output.url(draft_dir)} (trained in {root / draft_dir})" \
        if output.local_root is None else str(root / draft_dir)
    console().print(f"[green]trained[/] {summary['step']} steps, {summary['epoch']} epochs"
                    f"{resumed} -> {into}{chosen}")


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


class JobTraining:
    """`hsx extract`'s training of its job's `train:` section: the one training run
    (hsx_service.training), started and placed as the coordinator starts it — once the
    job is planned and its units are, beside the extraction or after it (the engines
    yield their GPUs to it), or fed by the engines (online) — reporting here.
    The extraction's hooks tell it what it waits for (`planned`, `engines`); `finish`
    ends it once the extraction has ended, and prints its outcome and vLLM's
    measurement."""

    def __init__(self, spec: Any, arbiter: Any) -> None:
        import threading

        self.spec = spec
        self.arbiter = arbiter
        self.plan: Any = None
        self.whole = False
        from hsx_service.training import EngineNodes

        self.extracted = threading.Event()
        self.engines = EngineNodes(self.extracted)  # `placed` is the extraction's hook
        self.run: Any = None
        self.outcome: Any = None
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def planned(self, plan: Any = None, whole: bool = False) -> None:
        """The job's plan is made (`plan`) or its units are all planned (`whole`)."""
        self.plan = plan or self.plan
        self.whole = self.whole or whole
        if self.plan is not None and self.whole:
            self._start(self.plan)

    def _start(self, plan: Any) -> None:
        import threading

        from hsx_service.training import TrainingRequest, TrainingRun

        with self._lock:
            if self.run is not None:
                return
            request = TrainingRequest.of_job(
                "local", self.spec.output, self.spec.train, self.spec, plan,
                extracted=self.extracted, engine_nodes=self.engines)
            self.run = TrainingRun(request, training_hooks(), self.arbiter)
            self.thread = threading.Thread(target=self._train, name="hsx-training",
                                           daemon=True)
            self.thread.start()

    def _train(self) -> None:
        self.outcome = self.run.run()

    def finish(self, extracted: bool) -> int:
        """The extraction ended (`extracted`: all of it); the training's exit code once
        it has ended too (it is stopped when the extraction failed)."""
        self.extracted.set()
        if not extracted:
            if self.run is not None:
                self.run.stop()
                if self.thread is not None:
                    self.thread.join()
            return 0
        if self.run is None:  # the job was complete already: nothing to wait for
            self._start(None)
        if self.thread is not None:
            self.thread.join()
        from hsx.draft import draft_folder
        from hsx.output import Output
        from hsx.output.layout import DRAFT_DIR

        outcome = self.outcome
        code = _training_failed(outcome, "run the job again to resume the training")
        if code is not None:
            return code
        output = Output(self.spec.output)
        root = draft_folder(output)
        _print_trained(outcome, output, root, DRAFT_DIR)
        if outcome.eval is not None and outcome.eval.get("error"):
            return error(f"the draft was trained but could not be measured: "
                          f"{outcome.eval['error']}; run `hsx eval-draft {output}` to "
                          "measure it", EXIT_FAILED)
        if outcome.eval is not None:
            _print_eval(outcome.eval, _eval_path(output, root))
        return 0


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
    for modality, part in (result.get("per_modality") or {}).items():
        console().print(
            f"  {modality} prompts ({part['prompts']}): mean acceptance length "
            f"{part['mean_acceptance_length']:.2f}, per position ["
            + " ".join(f"{r:.2f}" for r in part["acceptance_per_position"]) + "]",
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
    from hsx_workers.engines.vllm.settings import TargetSettings

    try:
        engine: TargetSettings | None = None
        target = args.target
        if args.job:  # the target as the job's engines load it: TP, dtype, its vllm: ones
            from hsx.spec import load_job
            from hsx_workers.engines.vllm.rules import target_settings

            job = load_job(args.job)
            engine = target_settings(job, tensor_parallel_size=args.tensor_parallel_size)
            target = target or job.model
        elif args.tensor_parallel_size:
            engine = TargetSettings(tensor_parallel_size=args.tensor_parallel_size)
        if args.draft is not None and draft_aux_count_unread(args.draft):
            return error(f"vLLM would read a wrong auxiliary layer count from {args.draft}; "
                         f"run `hsx fix-draft {args.draft}` first", EXIT_REFUSED)
        output = Output(args.output)
        root = draft_folder(output, args.draft_dir) if args.draft is None else None
        result = evaluate_draft(output, draft_root=args.draft_dir, prompts=args.prompts,
                                max_tokens=args.max_tokens, k=args.k, prefix=args.prefix,
                                draft=args.draft, target=target, engine=engine)
    except (StorageError, ValueError, FileNotFoundError) as err:
        return error(str(err), EXIT_REFUSED)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        return 0
    # Another draft than the output's (--draft) is measured, not recorded.
    _print_eval(result, None if root is None else _eval_path(output, root))
    return 0


# A target of this many layers shows the ids each method reads (an 8B Llama's 32).
_EXAMPLE_LAYERS = 32


def method_titles() -> str:
    """`EAGLE-3, DFlash, ...`: every method hsx trains."""
    return ", ".join(m.title for m in all_methods())


def _defaults(name: str) -> Any:
    """A new TrainSpec of the method: its own defaults."""
    from hsx.spec import TrainSpec

    return TrainSpec(method=name)


def _methods_epilog() -> str:
    """Every method and its own defaults, for `hsx train --help`."""
    import textwrap

    lines = ["draft methods (--method) and each one's defaults (--set and --spec override "
             "them):"]
    for m in all_methods():
        spec = _defaults(m.name)
        layers = f"{m.default_draft_layers} decoder layer" + "s" * (m.default_draft_layers > 1)
        served = "" if m.vllm_cpu_refuses is None else "; served by vLLM's GPU build only"
        text = (f"{m.title}, {m.summary}: {layers}; {spec.proposed_tokens} tokens a step "
                f"({m.proposed_by(spec)}: vLLM's num_speculative_tokens); loss "
                f"{spec.loss_fn}; reads ids {m.layers(_EXAMPLE_LAYERS)} of a "
                f"{_EXAMPLE_LAYERS}-layer target (`layers: [{m.name}]`){served}.")
        lines += textwrap.wrap(text, 86, initial_indent=f"  {m.name:<8}",
                               subsequent_indent=" " * 10)
    lines += ["", *textwrap.wrap(
        "The command ends by printing the line that serves the draft: vllm serve TARGET "
        "--speculative-config '{\"method\": METHOD, \"model\": DRAFT, "
        "\"num_speculative_tokens\": K, ...}'.", 88)]
    return "\n".join(lines)


def _serving_epilog() -> str:
    """What vLLM runs for each method's draft, for `hsx eval-draft --help`."""
    lines = ["the draft's method (its config.json) and what vLLM runs it with by default:"]
    for m in all_methods():
        served = "" if m.vllm_cpu_refuses is None else " (vLLM's GPU build only)"
        config = m.speculative_config("DRAFT", _defaults(m.name).proposed_tokens)
        lines.append(f"  {m.name:<8}{json.dumps(config)}{served}")
    return "\n".join(lines)


def _proposed_defaults() -> str:
    """`eagle3 3, dflash 7, ...`: what each method's draft proposes a step."""
    return ", ".join(f"{name} {_defaults(name).proposed_tokens}" for name in method_names())


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "train", help=f"train a draft ({method_titles()}) on an output (a path) or a job "
                      "(an id)",
        epilog=_methods_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="an output path or URI (file://, s3://: trains here), or a "
                                  "job id (the coordinator trains it)")
    p.add_argument("--follow", action="store_true",
                   help="start on the shards committed so far and keep up with the extraction")
    p.add_argument("--method", choices=method_names(),
                   help="draft method (default eagle3; the spec's when it names one); each "
                        "method's defaults are listed below")
    p.add_argument("--spec", help="TrainSpec file (YAML or JSON)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one TrainSpec field, e.g. --set epochs=3 (repeatable)")
    p.add_argument("--detach", action="store_true",
                   help="job id only: start the training and return at once")
    p.add_argument("--draft-dir", help="output only: the local folder to train the draft "
                                       "in (default the output's; for s3:// a folder in "
                                       "$HSX_CACHE, ~/.cache/hsx, uploaded to the bucket)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="output only: the target's own code may run (a model that needs "
                        "it); never taken from the output's manifest")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "eval-draft", help="acceptance of an output's trained draft in vLLM (greedy, the "
                           f"draft's method: {', '.join(method_names())})",
        epilog=_serving_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", help="the output the draft was trained on (prompts come from it)")
    p.add_argument("--draft-dir", help="the local folder the draft was trained in (as "
                                       "`hsx train --draft-dir`; default the output's; for "
                                       "s3:// the bucket's draft is downloaded there)")
    p.add_argument("--draft", help="draft folder (default: <draft-dir>/draft; another one is "
                                   "measured but not recorded)")
    p.add_argument("--target", help="target model (default: the job's with --job, else the "
                                    "model the output's manifest names, without its own "
                                    "code)")
    p.add_argument("--job", help="the job file that made the output: vLLM loads the target "
                                 "as its engines did (tensor_parallel_size, dtype, its "
                                 "`vllm:` engine arguments), as the coordinator's evaluation "
                                 "does")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="GPUs the target spans (default: the job's, else 1)")
    p.add_argument("--k", type=int, default=None,
                   help="num_speculative_tokens (default: what the trained draft proposes, "
                        "from its training's spec; with each method's defaults: "
                        f"{_proposed_defaults()})")
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
