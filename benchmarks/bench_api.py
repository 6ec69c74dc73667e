"""Coordinator under polling load: 100 clients hammer GET /v1/jobs/{id} during a job.

One run, one job, three windows of equal length while the job extracts:
before (no load) -> load (100 concurrent clients polling the job's status) -> after
(no load). The job's tokens/s in the load window is compared with the mean of the two
quiet windows around it, so slow drift of the machine cancels out. The clients report
their error count and p50/p99 latency.

Targets (issue 3): no errors, p99 < 100 ms, tokens/s ratio >= 0.95.

Caveat on a 2-core machine: the load generator itself runs on the same cores as the
engines, so the ratio measures coordinator + load-generator cost together; the result
file records the core count.

    .venv/bin/python benchmarks/bench_api.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import itertools

from common import (
    RESULTS_DIR,
    machine_info,
    median,
    ratio,
    save_section,
    table,
    verdict,
)

TOKEN = "bench-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(client: httpx.Client, job_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/jobs/{job_id}")
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def _tokens_at(client: httpx.Client, job_id: str) -> tuple[float, int]:
    return time.monotonic(), int(_status(client, job_id)["tokens_done"])


async def _poll(url: str, job_id: str, clients: int, seconds: float) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=url, limits=limits, headers=headers,
                                 timeout=10) as http:

        async def one_client() -> None:
            nonlocal errors
            while time.monotonic() < deadline:
                start = time.perf_counter()
                try:
                    response = await http.get(f"/v1/jobs/{job_id}")
                    if response.status_code != 200:
                        errors += 1
                except httpx.HTTPError:
                    errors += 1
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(one_client() for _ in range(clients)))
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000

    return {
        "requests": len(latencies),
        "errors": errors,
        "requests_per_s": len(latencies) / seconds,
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": latencies[-1] * 1000 if latencies else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small job, short windows")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--window", type=float, default=10.0, help="seconds per window")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "cpu.json")
    args = parser.parse_args(argv)
    window = 3.0 if args.quick else args.window
    samples = 1500 if args.quick else 6000

    from hsx_workers.tiny_models import make_chat_dataset, make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="hsx-bench-api-"))
    model = make_tiny_model(work / "model", "llama")
    dataset = make_chat_dataset(work / "chats.jsonl", n=samples, seed=1).path
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HSX_API_TOKEN": TOKEN, "HSX_ALLOWED_ROOTS": str(work),
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "hsx.cli", "serve", "--port", str(port),
         "--ledger", str(work / "ledger.sqlite")],
        stdout=open(work / "serve.log", "wb"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
    )
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if http.get("/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"server did not start; see {work / 'serve.log'}")
            time.sleep(0.3)
        spec = {"model": str(model), "dataset": str(dataset), "output": str(work / "out"),
                "layers": [1, 2, 3, 4], "max_seq_len": 512, "unit_tokens": 8192}
        job = http.post("/v1/jobs", json={"spec": spec})
        job.raise_for_status()
        job_id = job.json()["id"]
        # Wait until the engine runs and tokens flow.
        while _status(http, job_id)["tokens_done"] == 0:
            if _status(http, job_id)["state"] in ("failed", "cancelled"):
                raise SystemExit(f"job failed: {_status(http, job_id)['last_error']}")
            time.sleep(0.5)
        time.sleep(window / 2)
        marks = [_tokens_at(http, job_id)]
        time.sleep(window)
        marks.append(_tokens_at(http, job_id))
        load = asyncio.run(_poll(url, job_id, args.clients, window))
        marks.append(_tokens_at(http, job_id))
        time.sleep(window)
        marks.append(_tokens_at(http, job_id))
        state = _status(http, job_id)["state"]
    finally:
        http.close()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()

    rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(marks)]
    before, during, after = rates
    quiet = median([before, after])
    rate_ratio = ratio(during, quiet)
    if state != "running":
        print(f"warning: the job was {state} by the end; windows may be partial")
    payload = {
        "clients": args.clients,
        "window_s": window,
        "samples": samples,
        "tokens_per_s": {"before": before, "during_load": during, "after": after},
        "load": load,
        "ratio_tokens_per_s": rate_ratio,
        "targets": {"errors": 0, "p99_ms": 100, "tokens_per_s_ratio": 0.95},
        "verdicts": {
            "errors": "PASS" if load["errors"] == 0 else "MISS",
            "p99": "PASS" if load["p99_ms"] < 100 else "MISS",
            "ratio": verdict(rate_ratio, 0.95),
        },
        "quick": args.quick,
    }
    save_section(args.out, "api_polling", payload, machine_info())
    print(table(
        ["measure", "value", "target", "verdict"],
        [
            ["errors", load["errors"], 0, payload["verdicts"]["errors"]],
            ["p50 latency ms", load["p50_ms"], "-", "-"],
            ["p99 latency ms", load["p99_ms"], "< 100", payload["verdicts"]["p99"]],
            ["requests/s", load["requests_per_s"], "-", "-"],
            ["tokens/s quiet (median of before/after)", quiet, "-", "-"],
            ["tokens/s under load", during, "-", "-"],
            ["ratio", rate_ratio, ">= 0.95", payload["verdicts"]["ratio"]],
        ],
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
