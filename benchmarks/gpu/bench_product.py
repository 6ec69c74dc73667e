"""The whole product once at real size, as a user runs it: `hsx serve`, one job over REST
with `train:` and the evaluation, on one GPU, timed from submit to `draft/eval.json`.

- `drop`  vLLM's capture-and-drop ceiling on the same rows in the same run (bench_vllm.py's
          child: `LLM.generate`, extract_hidden_states, states gathered and dropped).
- `job`   `hsx serve` in a subprocess; `POST /v1/jobs` of an 8B-shaped Llama
          (`vllm: {load_format: dummy}`: vLLM fills random weights), the rows below,
          layers [2, 16, 29, 32], bf16 on the local disk, `train: {steps, checkpoint_every}`
          and the default evaluation (32 held-out prompts, k = 3). Nothing else is set: the
          coordinator plans where the engine, the trainer and the evaluation run.

Reported: time to the first committed shard; extraction tokens/s (the job's average over
the time it dispatched) ÷ drop; the gap between the end of the extraction and the
trainer's first step; training tokens/s; the whole time from submit to draft/eval.json;
and every `waiting_for` the job and its training showed, with when.

`--online` runs, instead of the one job, the same job twice on the one GPU, without the
evaluation (the weights are random): `offline` (the plan trains after the extraction,
from its stored shards) and `online` (`train: {online: true}`: the plan gives the
trainer 0.3 of the engine's GPU, the engine captures each epoch again into the stream).
Reported for each: training tokens/s (median of the steps after the 10th) and the share
of the trainer's time spent waiting, the bytes the output holds besides draft/, the
target's tokens captured, the whole time; and the GPU time split: `nvidia-smi pmon`
samples every second of each process's SM share, summed by role (the trainer's actor
against the target's engine processes), with each role's peak framebuffer memory.
Ratios online ÷ offline: training tokens/s, whole time, bytes stored.

`--online --baseline DIR` runs instead the online job alone, `--reps` times on this tree
and on DIR's alternately (in turn, rotated each repetition): DIR holds the code of an
earlier hsx (`git archive REV client workers service | tar -x -C DIR`), whose `hsx
serve` runs with DIR's packages first on its path. Reported: each run's training tokens/s
and submit -> trained seconds, and this tree ÷ DIR's (medians): the new online stream
(Ray's object store) against the one-node folder in /dev/shm it replaced.

The target's weights are random, so the draft's acceptance means nothing here; the
trainer still reads the target's embeddings, lm_head and final norm (speculators'
`load_verifier_weights`), so the model folder gets those three tensors (random) beside
its config.

    PYTHONPATH=/tmp/site:$PWD/client:$PWD/workers:$PWD/service:$PWD/benchmarks \\
      python -m benchmarks.gpu.bench_product --out $OUT/product.json [--online]
    .venv/bin/python -m benchmarks.gpu.bench_product --cpu --out /tmp/p.json   # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.gpu.bench_vllm import SHAPE_8B, Bench, log, machine

TOKEN = "bench-product-0123456789"


def verifier_weights(model: Path) -> None:
    """The tensors of the target the draft trainer reads (random, bf16)."""
    import torch
    from safetensors.torch import save_file

    hidden, vocab = int(SHAPE_8B["hidden_size"]), int(SHAPE_8B["vocab_size"])
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=gen) * 0.02)
        .to(torch.bfloat16),
        "lm_head.weight": (torch.randn(vocab, hidden, generator=gen) * 0.02).to(torch.bfloat16),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """`hsx serve` in its own session, as a user starts it."""

    def __init__(self, work: Path, name: str, tree: Path | None = None) -> None:
        self.port = free_port()
        self.log = work / f"{name}-serve.log"
        env = {**os.environ, "HSX_API_TOKEN": TOKEN, "HSX_ALLOWED_ROOTS": str(work)}
        env.pop("RAY_ADDRESS", None)
        if tree is not None:  # another hsx's code first on the path (--baseline)
            packages = ":".join(str(tree / p) for p in ("client", "workers", "service"))
            env["PYTHONPATH"] = f"{packages}:{env.get('PYTHONPATH', '')}"
        self.proc = subprocess.Popen(
            # A ledger per run: another tree's coordinator cannot read this one's jobs.
            [sys.executable, "-m", "hsx.cli", "serve", "--port", str(self.port), "--ledger",
             str(work / f"{name}-ledger.sqlite")],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
            start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self, timeout: float = 300) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hsx serve exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"hsx serve never became ready: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


class GpuSplit:
    """`nvidia-smi pmon` every second while a job runs: each process's SM share and
    framebuffer memory, by role (its command names the trainer's Ray actor, else it is
    the target's engine). Nothing when the machine has no nvidia-smi."""

    def __init__(self, log: Path) -> None:
        import shutil

        self.log = log
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "pmon", "-s", "um", "-d", "1"],
                                         stdout=open(log, "w"),  # noqa: SIM115
                                         stderr=subprocess.STDOUT)

    def stop(self) -> dict[str, Any]:
        if self.proc is None:
            return {"available": False}
        self.proc.terminate()
        self.proc.wait(timeout=30)
        return split_of(self.log.read_text())


def split_of(text: str) -> dict[str, Any]:
    """SM-percent-seconds and peak memory by role from `nvidia-smi pmon -s um` lines."""
    names: list[str] = []
    sm: dict[str, float] = {"draft": 0.0, "target": 0.0}
    peak_mb: dict[str, float] = {"draft": 0.0, "target": 0.0}
    seconds: set[str] = set()
    samples = 0
    for line in text.splitlines():
        if line.startswith("#"):
            if not names and "pid" in line:
                names = line.lstrip("#").split()
            continue
        fields = line.split()
        if not names or len(fields) < len(names) - 1:
            continue
        row = dict(zip(names, fields, strict=False))
        command = " ".join(fields[len(names) - 1:]) if "command" in names else ""
        role = "draft" if "Trainer" in command else "target"
        samples += 1
        with_sm = row.get("sm", "-")
        if with_sm not in ("-", ""):
            sm[role] += float(with_sm)
        fb = row.get("fb", "-")
        if fb not in ("-", ""):
            peak_mb[role] = max(peak_mb[role], float(fb))
        seconds.add(row.get("gpu", "0") + "/" + str(samples))
    busy = sum(sm.values())
    return {"available": True, "samples": samples,
            "sm_percent_seconds": {k: round(v, 1) for k, v in sm.items()},
            "share_of_busy": {k: round(v / busy, 3) if busy else None for k, v in sm.items()},
            "peak_fb_mb": peak_mb}


def trainer_seconds(output: Path) -> dict[str, Any]:
    """From draft/metrics.jsonl: the trainer's compute and waiting seconds, and its
    training tokens/s (median of the steps after the 10th)."""
    import statistics

    path = output / "draft" / "metrics.jsonl"
    if not path.exists():
        return {}
    metrics = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    metrics = [m for m in metrics if "step_s" in m]
    if not metrics:
        return {}
    steady = [m["tokens_per_s"] for m in metrics[10:]] or [m["tokens_per_s"] for m in metrics]
    return {"steps": metrics[-1]["step"],
            "compute_s": round(sum(m["step_s"] - m["wait_s"] for m in metrics), 1),
            "wait_s": round(sum(m["wait_s"] for m in metrics), 1),
            "wait_fraction": round(metrics[-1]["wait_fraction"], 3),
            "tokens_per_s_median": round(statistics.median(steady), 1)}


def stored_bytes(output: Path) -> int:
    """Bytes under the output, its draft/ left out (what the extraction stored)."""
    return sum(p.stat().st_size for p in output.rglob("*")
               if p.is_file() and "draft" not in p.relative_to(output).parts)


def run_job(bench: Bench, args: argparse.Namespace, drop_tps: float | None,
            name: str = "product", train_extra: dict[str, Any] | None = None,
            tree: Path | None = None) -> dict[str, Any]:
    from hsx.client import Client, NotFoundError
    from hsx.output.layout import DRAFT_EVAL

    work = bench.work
    output = work / f"{name}-out"
    vllm: dict[str, Any] = {} if bench.cpu else {"load_format": "dummy"}
    train: dict[str, Any] = {"steps": args.steps, "checkpoint_every": args.checkpoint_every,
                             **(train_extra or {})}
    spec = {"model": str(bench.model), "dataset": str(work / "rows.jsonl"),
            "output": str(output), "layers": bench.layers, "max_seq_len": bench.length + 64,
            "vllm": vllm, "train": train}
    server = Serve(work, name, tree)
    timeline: dict[str, float] = {}
    waits: list[dict[str, Any]] = []
    split = None
    try:
        server.ready()
        client = Client(server.url, token=TOKEN, timeout=60)
        split = GpuSplit(work / f"{name}-pmon.log")
        submitted = time.time()
        job = client.submit(spec, job_id=name)
        shown: dict[str, str | None] = {"job": None, "train": None}
        deadline = time.monotonic() + args.timeout
        status = training = None
        while time.monotonic() < deadline:
            now = time.time()
            status = client.get(job.id)
            if status.state.value == "running":
                timeline.setdefault("job_running", now)
            if status.units_done >= 1:
                timeline.setdefault("first_shard_seen", now)
            if status.waiting_for != shown["job"]:
                shown["job"] = status.waiting_for
                waits.append({"at": now, "who": "job", "waiting_for": status.waiting_for})
            try:
                training = client.train_status(job.id)
            except NotFoundError:
                training = None
            if training is not None:
                if training.waiting_for != shown["train"]:
                    shown["train"] = training.waiting_for
                    waits.append({"at": now, "who": "training",
                                  "waiting_for": training.waiting_for})
                timeline.setdefault(f"train_{training.state.value}", now)
            if status.state.finished and training is not None and training.state.finished:
                break
            time.sleep(0.5)
        ended = time.time()
        gpu_split, split = split.stop(), None
        if status is None or training is None:
            raise RuntimeError("the job or its training never answered")
        evaluation = None
        if (output / DRAFT_EVAL).exists():
            evaluation = json.loads((output / DRAFT_EVAL).read_text())
        tps = status.tokens_per_s_avg
        extraction_end = status.finished_at or ended
        first_step = training.first_step_at
        result: dict[str, Any] = {
            "spec": spec,
            "job_state": status.state.value, "job_error": status.last_error,
            "train_state": training.state.value, "train_error": training.error,
            "plan": status.plan.model_dump() if status.plan else None,
            "tokens": status.tokens_done, "bytes": status.bytes, "shards": status.shards,
            "extraction_tokens_per_s": tps,
            "extraction_over_drop": round(tps / drop_tps, 3) if drop_tps else None,
            "seconds": {
                "submit_to_running": _since(submitted, timeline.get("job_running")),
                "submit_to_first_shard": _since(submitted, timeline.get("first_shard_seen")),
                "submit_to_extraction_end": _since(submitted, status.finished_at),
                "extraction_end_to_first_train_step": _since(extraction_end, first_step),
                "submit_to_train_done": _since(submitted, timeline.get("train_done")),
                "submit_to_eval_json": _since(submitted, (evaluation or {}).get("time")),
                "whole": round(ended - submitted, 1),
            },
            "train": {"steps": training.step, "tokens_per_s": training.tokens_per_s,
                      "plan": training.plan.model_dump() if training.plan else None,
                      "restarts": training.restarts},
            "eval": evaluation,
            "trainer": trainer_seconds(output),
            "stored_bytes": stored_bytes(output),
            "gpu_split": gpu_split,
            "online": json.loads((output / "complete.json").read_text()).get("online")
            if (output / "complete.json").exists() else None,
            "waits": [{**w, "at": round(w["at"] - submitted, 1)} for w in waits],
            "timeline": {k: round(v - submitted, 1) for k, v in timeline.items()},
        }
        return result
    finally:
        if split is not None:
            split.stop()
        server.stop()
        (work / f"{name}-serve-tail.log").write_text(server.log.read_text()[-20000:])


def _since(start: float | None, end: float | None) -> float | None:
    return round(end - start, 1) if start is not None and end is not None else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/hsx-bench-product.json")
    p.add_argument("--workdir", default="/tmp/hsx-bench-product")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-drop", action="store_true", help="skip the ceiling phase")
    p.add_argument("--cpu", action="store_true", help="check the script on CPU (tiny model)")
    p.add_argument("--online", action="store_true",
                   help="the job offline then online, without the evaluation")
    p.add_argument("--baseline", type=Path, default=None,
                   help="with --online: the online job on this tree against DIR's code")
    p.add_argument("--ab-reps", type=int, default=2,
                   help="with --baseline: runs of each tree")
    p.add_argument("--ab-trees", default="new,baseline",
                   help="with --baseline: which trees run (one alone: on a machine where the "
                        "other ran)")
    args = p.parse_args()
    # What Bench (bench_vllm.py) reads for its set-up and its drop child.
    args.reps, args.tmpfs, args.child_timeout = 1, "/dev/shm/hsx-bench-product", 900.0
    args.gpu_memory_utilization, args.profile, args.inflight, args.layers = 0.85, False, 0, None
    bench = Bench(args)
    bench.setup()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "args": vars(args), "machine": machine(),
                              "model": bench.result["model"], "errors": {}}
    out = Path(args.out)

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))

    drop_tps = None
    if not args.no_drop:
        try:
            result["drop"] = bench.drop()
            drop_tps = float(max(r["tokens_per_s"] for r in result["drop"]["runs"]))
            log(f"drop: {drop_tps:,.0f} tok/s")
        except Exception:
            result["errors"]["drop"] = traceback.format_exc()[-4000:]
        save()
    if not bench.cpu:
        verifier_weights(bench.model)
    if args.online and args.baseline is not None:
        online_ab(bench, args, result, save)
        return 0 if not result["errors"] else 1
    if args.online:
        online_pair(bench, args, result, save)
        return 0 if not result["errors"] else 1
    try:
        result["job"] = run_job(bench, args, drop_tps)
        log(json.dumps(result["job"]["seconds"]))
    except Exception:
        result["errors"]["job"] = traceback.format_exc()[-4000:]
    save()
    return 0 if not result["errors"] else 1


def online_pair(bench: Bench, args: argparse.Namespace, result: dict[str, Any],
                save: Any) -> None:
    """The job offline, then online (module docstring), and online ÷ offline."""
    for name, extra in (("offline", {"eval_prompts": 0}),
                        ("online", {"eval_prompts": 0, "online": True})):
        try:
            result[name] = run_job(bench, args, None, name, extra)
            log(f"{name}: {json.dumps(result[name]['trainer'])} "
                f"split {json.dumps(result[name]['gpu_split'])}")
        except Exception:
            result["errors"][name] = traceback.format_exc()[-4000:]
        save()
    off, on = result.get("offline"), result.get("online")
    if off and on and off["trainer"] and on["trainer"]:
        result["online_over_offline"] = {
            "train_tokens_per_s": round(on["trainer"]["tokens_per_s_median"]
                                        / off["trainer"]["tokens_per_s_median"], 3),
            "whole_seconds": round(on["seconds"]["whole"] / off["seconds"]["whole"], 3),
            "stored_bytes": round(on["stored_bytes"] / max(off["stored_bytes"], 1), 5),
        }
    save()


def online_ab(bench: Bench, args: argparse.Namespace, result: dict[str, Any],
              save: Any) -> None:
    """The online job on this tree and on `args.baseline`'s, alternately (module
    docstring), and this tree ÷ the baseline's."""
    import statistics

    asked = args.ab_trees.split(",")
    if not asked or set(asked) - {"new", "baseline"}:
        raise SystemExit(f"--ab-trees takes new, baseline or both, got {args.ab_trees!r}")
    trees = {name: tree for name, tree in (("new", None), ("baseline", args.baseline.resolve()))
             if name in asked}
    runs: dict[str, list[dict[str, Any]]] = {"new": [], "baseline": []}
    for rep in range(args.ab_reps):
        order = list(trees) if rep % 2 == 0 else list(trees)[::-1]
        for name in order:
            label = f"online-{name}-{rep}"
            try:
                run = run_job(bench, args, None, label, {"eval_prompts": 0, "online": True},
                              tree=trees[name])
                runs[name].append({"trainer": run["trainer"], "seconds": run["seconds"],
                                   "train_state": run["train_state"],
                                   "job_state": run["job_state"]})
                log(f"{label}: {json.dumps(run['trainer'])} {json.dumps(run['seconds'])}")
            except Exception:
                result["errors"][label] = traceback.format_exc()[-4000:]
            result["online_ab"] = {"baseline": str(args.baseline), "runs": runs}
            save()

    def median(name: str, pick: Any) -> float | None:
        values = [v for r in runs[name] if (v := pick(r)) is not None]
        return statistics.median(values) if values else None

    tps = {n: median(n, lambda r: r["trainer"].get("tokens_per_s_median")) for n in runs}
    done = {n: median(n, lambda r: r["seconds"].get("submit_to_train_done")) for n in runs}
    result["online_ab"]["new_over_baseline"] = {
        "train_tokens_per_s": round(tps["new"] / tps["baseline"], 3)
        if tps["new"] and tps["baseline"] else None,
        "submit_to_trained_seconds": round(done["new"] / done["baseline"], 3)
        if done["new"] and done["baseline"] else None}
    log(json.dumps(result["online_ab"]["new_over_baseline"]))
    save()


if __name__ == "__main__":
    sys.exit(main())
