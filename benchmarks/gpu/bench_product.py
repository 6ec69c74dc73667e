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

The target's weights are random, so the draft's acceptance means nothing here; the
trainer still reads the target's embeddings, lm_head and final norm (speculators'
`load_verifier_weights`), so the model folder gets those three tensors (random) beside
its config.

    PYTHONPATH=/tmp/site:$PWD/client:$PWD/workers:$PWD/service:$PWD/benchmarks \\
      python3 benchmarks/gpu/bench_product.py --out $OUT/product.json
    .venv/bin/python benchmarks/gpu/bench_product.py --cpu --out /tmp/p.json   # CPU check
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vllm import SHAPE_8B, Bench, log, machine

TOKEN = "bench-product"


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

    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.log = work / "serve.log"
        env = {**os.environ, "HSX_API_TOKEN": TOKEN, "HSX_ALLOWED_ROOTS": str(work)}
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hsx.cli", "serve", "--port", str(self.port), "--ledger",
             str(work / "ledger.sqlite")],
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


def run_job(bench: Bench, args: argparse.Namespace, drop_tps: float | None) -> dict[str, Any]:
    from hsx.client import Client, NotFoundError
    from hsx.output.layout import DRAFT_EVAL

    work = bench.work
    output = work / "product-out"
    vllm: dict[str, Any] = {} if bench.cpu else {"load_format": "dummy"}
    train: dict[str, Any] = {"steps": args.steps, "checkpoint_every": args.checkpoint_every}
    spec = {"model": str(bench.model), "dataset": str(work / "rows.jsonl"),
            "output": str(output), "layers": bench.layers, "max_seq_len": bench.length + 64,
            "vllm": vllm, "train": train}
    server = Serve(work)
    timeline: dict[str, float] = {}
    waits: list[dict[str, Any]] = []
    try:
        server.ready()
        client = Client(server.url, token=TOKEN, timeout=60)
        submitted = time.time()
        job = client.submit(spec, job_id="product")
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
            "waits": [{**w, "at": round(w["at"] - submitted, 1)} for w in waits],
            "timeline": {k: round(v - submitted, 1) for k, v in timeline.items()},
        }
        return result
    finally:
        server.stop()
        (work / "serve-tail.log").write_text(server.log.read_text()[-20000:])


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
    args = p.parse_args()
    # What Bench (bench_vllm.py) reads for its set-up and its drop child.
    args.reps, args.tmpfs, args.child_timeout = 1, "/dev/shm/hsx-bench-product", 900.0
    args.gpu_memory_utilization, args.profile, args.inflight = 0.85, False, 0
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
    try:
        result["job"] = run_job(bench, args, drop_tps)
        log(json.dumps(result["job"]["seconds"]))
    except Exception:
        result["errors"]["job"] = traceback.format_exc()[-4000:]
    save()
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
