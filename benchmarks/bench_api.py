"""Coordinator under load: 100 polling clients and 10 SSE followers while a job extracts.

`hsx serve` (with an API token) runs one job on a vLLM CPU engine. Windows of equal
length alternate while the job runs: quiet, load, quiet, load, ..., quiet. In a load
window `--pollers` clients each `GET /v1/jobs/{id}` every `--poll-interval` seconds (at
random phases) and `--followers` clients follow `GET /v1/jobs/{id}/events`. Targets
(issue 10): no errors, p99 latency < 100 ms, and the job's tokens/s in the load windows
>= 0.95 of the quiet windows of the same run.

How the job's speed is measured: from the output's commit records, not through the API
under test. Each committed unit's tokens are counted at the commit file's mtime; a
window's rate is the tokens committed in it over its length (`unit_tokens` is small, so a
window holds many units). The ratio is the load windows' total rate over the quiet
windows' (each load window also gets its own ratio against the mean of its two
neighbours, so slow drift of a shared machine shows).

The load generator is one asyncio process speaking HTTP/1.1 over raw sockets (keep-alive,
no HTTP library): its own cost per request is a few tens of microseconds, so on the 2
shared cores it takes as little as possible from the engine the job runs on. Latency is
from writing the request to the last byte of the response. An SSE follower counts an
error when its stream breaks before the job ends; its latency is the age of each event
(arrival time minus the status's `updated_at`, server and client on one clock).

Each window records the load average and the CPU seconds of the coordinator's own
process and of the rest of its process tree (Ray, the engine). `--profile` runs py-spy
(`pip install py-spy`) on the coordinator during the last load window (`--nonblocking`,
so the profiler does not stop it; `--gil`, so only threads running Python count) and
stores the hottest functions; the raw stacks go to api-profile-LABEL.txt.tmp beside the
results file.

    .venv/bin/python -m benchmarks.bench_api --label after [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    campaign_path,
    machine_info,
    process_cpu_seconds,
    ratio,
    save_section,
    table,
    verdict,
)

TOKEN = "bench-token-0123456789"
TARGETS = {"errors": 0, "p99_ms": 100.0, "tokens_per_s_ratio": 0.95}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------- load generator


@dataclass
class LoadStats:
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    error_kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    sse_events: int = 0
    sse_age_ms: list[float] = field(default_factory=list)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] += 1


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return status, body


async def _poller(host: str, port: int, job_id: str, interval: float, until: float,
                  stats: LoadStats) -> None:
    request = (f"GET /v1/jobs/{job_id} HTTP/1.1\r\nHost: {host}\r\n"
               f"Authorization: Bearer {TOKEN}\r\nAccept: application/json\r\n\r\n").encode()
    await asyncio.sleep(random.uniform(0, interval))  # spread the clients' phases
    writer: asyncio.StreamWriter | None = None
    reader: asyncio.StreamReader | None = None
    next_at = time.monotonic()
    while time.monotonic() < until:
        start = time.perf_counter()
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            assert reader is not None
            writer.write(request)
            status, body = await asyncio.wait_for(_read_response(reader), timeout=10)
            if status != 200 or not body.startswith(b"{"):
                stats.error(f"status {status}")
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as err:
            stats.error(type(err).__name__)
            if writer is not None:
                writer.close()
            writer = reader = None
        stats.latencies_ms.append((time.perf_counter() - start) * 1000)
        next_at += interval
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    if writer is not None:
        writer.close()


async def _follower(host: str, port: int, job_id: str, until: float, stats: LoadStats) -> None:
    request = (f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: {host}\r\n"
               f"Authorization: Bearer {TOKEN}\r\nAccept: text/event-stream\r\n\r\n").encode()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as err:
        stats.error(f"sse connect {type(err).__name__}")
        return
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            stats.error("sse status")
            return
        while time.monotonic() < until:
            # Chunked transfer: the chunk framing lines are skipped, `data:` lines parsed.
            left = max(0.1, until - time.monotonic())
            line = await asyncio.wait_for(reader.readline(), timeout=left)
            if not line:
                stats.error("sse closed early")
                return
            if line.startswith(b"data: "):
                status = json.loads(line[6:])
                stats.sse_events += 1
                if status.get("updated_at"):
                    stats.sse_age_ms.append((time.time() - float(status["updated_at"])) * 1000)
                if status.get("state") in ("succeeded", "failed", "cancelled"):
                    return
    except asyncio.TimeoutError:
        return  # the window ended while waiting for the next event: not an error
    except (OSError, asyncio.IncompleteReadError, ValueError) as err:
        stats.error(f"sse {type(err).__name__}")
    finally:
        writer.close()


async def _load(url: str, job_id: str, pollers: int, followers: int, interval: float,
                seconds: float) -> LoadStats:
    host, port = url.removeprefix("http://").split(":")
    stats = LoadStats()
    until = time.monotonic() + seconds
    await asyncio.gather(
        *(_poller(host, int(port), job_id, interval, until, stats) for _ in range(pollers)),
        *(_follower(host, int(port), job_id, until, stats) for _ in range(followers)),
    )
    return stats


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


# ------------------------------------------------------------------- measurement


def _commits(output: Path) -> list[tuple[float, int]]:
    """(mtime, tokens) of every committed unit of the output."""
    out = []
    commits = output / "commits"
    if commits.is_dir():
        for entry in os.scandir(commits):
            if entry.name.endswith(".json"):
                with contextlib.suppress(OSError, ValueError):
                    record = json.loads(Path(entry.path).read_text())
                    out.append((entry.stat().st_mtime, int(record["tokens"])))
    return sorted(out)


def _tokens_between(commits: list[tuple[float, int]], t0: float, t1: float) -> int:
    return sum(tokens for at, tokens in commits if t0 <= at < t1)


def _tree_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of process `pid` itself, and of all its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        own = sum(root.cpu_times()[:2])
        rest = 0.0
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                rest += sum(child.cpu_times()[:2])
    except psutil.Error:
        return 0.0, 0.0
    return own, rest


def _status(http: httpx.Client, job_id: str) -> dict[str, Any]:
    response = http.get(f"/v1/jobs/{job_id}")
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def _py_spy() -> str:
    """py-spy from PATH or beside this Python (a virtualenv's bin/)."""
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    return found


def _profile_summary(raw: Path, top: int = 25) -> dict[str, Any]:
    """Hottest functions of a py-spy `--format raw` file: self and inclusive sample shares."""
    self_counts: collections.Counter[str] = collections.Counter()
    incl_counts: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        threads[frames[0]] += count
        self_counts[frames[-1]] += count
        for frame in set(frames[1:]):
            incl_counts[frame] += count
    if not total:
        return {"samples": 0}

    def share(counter: collections.Counter[str]) -> list[list[Any]]:
        return [[name, round(n / total, 4)] for name, n in counter.most_common(top)]

    return {"samples": total, "threads": share(threads), "self": share(self_counts),
            "inclusive": share(incl_counts)}


# ------------------------------------------------------------------- the run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short windows, one load window")
    parser.add_argument("--pollers", type=int, default=100, help="clients polling the status")
    parser.add_argument("--followers", type=int, default=10, help="clients following SSE")
    parser.add_argument("--poll-interval", type=float, default=1.0,
                        help="seconds between one poller's requests")
    parser.add_argument("--window", type=float, default=20.0, help="seconds per window")
    parser.add_argument("--rounds", type=int, default=3, help="load windows (each between quiet)")
    parser.add_argument("--samples", type=int, default=60000, help="rows of the job's dataset")
    parser.add_argument("--profile", action="store_true", help="py-spy the last load window")
    parser.add_argument("--label", default="", help="results section suffix, e.g. before/after")
    parser.add_argument("--note", help="free text stored with the results")
    parser.add_argument("--out", type=Path, default=campaign_path("api", "api.json"))
    args = parser.parse_args(argv)
    window = 6.0 if args.quick else args.window
    rounds = 1 if args.quick else args.rounds
    samples = 15000 if args.quick else args.samples

    from hsx_workers.tiny_models import make_chat_dataset, make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="hsx-bench-api-"))
    model = make_tiny_model(work / "model", "llama")
    dataset = make_chat_dataset(work / "chats.jsonl", n=samples, seed=1).path
    output = work / "out"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HSX_API_TOKEN": TOKEN, "HSX_ALLOWED_ROOTS": str(work),
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("RAY_ADDRESS", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "hsx.cli", "serve", "--port", str(port),
         "--ledger", str(work / "ledger.sqlite")],
        stdout=open(work / "serve.log", "wb"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
        start_new_session=True,
    )
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    windows: list[dict[str, Any]] = []
    profile: dict[str, Any] | None = None
    final_state = "?"
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if http.get("/readyz").status_code == 200:
                    break
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"server did not start; see {work / 'serve.log'}")
            time.sleep(0.3)
        spec = {"model": str(model), "dataset": str(dataset), "output": str(output),
                "layers": [1, 2, 3, 4], "max_seq_len": 512, "unit_tokens": 2048}
        job = http.post("/v1/jobs", json={"spec": spec})
        job.raise_for_status()
        job_id = job.json()["id"]
        while not _commits(output):  # the engine runs and units commit
            status = _status(http, job_id)
            if status["state"] in ("failed", "cancelled", "succeeded"):
                raise SystemExit(f"job ended early: {status['state']} {status['last_error']}")
            time.sleep(0.5)
        time.sleep(window / 2)
        kinds = ["quiet"] + ["load", "quiet"] * rounds
        for i, kind in enumerate(kinds):
            cpu0, own0 = _tree_cpu(server.pid), process_cpu_seconds()
            t0, load0 = time.time(), os.getloadavg()
            entry: dict[str, Any] = {"kind": kind, "start": t0}
            if kind == "quiet":
                time.sleep(window)
            else:
                spy = None
                last_load = i == len(kinds) - 2
                if args.profile and last_load:
                    raw = work / "profile.txt"
                    spy = subprocess.Popen(
                        [_py_spy(), "record", "--pid", str(server.pid), "--duration",
                         str(int(window)), "--rate", "100", "--nonblocking", "--gil", "--threads",
                         "--format", "raw", "--output", str(raw)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                stats = asyncio.run(_load(url, job_id, args.pollers, args.followers,
                                          args.poll_interval, window))
                if spy is not None:
                    spy.wait(timeout=60)
                    if raw.exists():
                        profile = _profile_summary(raw)
                        # The raw stacks stay out of git (*.tmp); the summary is kept.
                        shutil.copy(raw, args.out.with_name(
                            f"api-profile{'-' + args.label if args.label else ''}.txt.tmp"))
                entry.update(
                    requests=len(stats.latencies_ms), errors=stats.errors,
                    error_kinds=dict(stats.error_kinds),
                    p50_ms=_pct(stats.latencies_ms, 0.5), p99_ms=_pct(stats.latencies_ms, 0.99),
                    max_ms=max(stats.latencies_ms, default=None),
                    sse_events=stats.sse_events, sse_age_p50_ms=_pct(stats.sse_age_ms, 0.5),
                    sse_age_p99_ms=_pct(stats.sse_age_ms, 0.99),
                    latencies_ms=stats.latencies_ms,
                )
            t1 = time.time()
            cpu1 = _tree_cpu(server.pid)
            entry.update(end=t1, loadavg_start=list(load0), loadavg_end=list(os.getloadavg()),
                         coordinator_cpu_s=cpu1[0] - cpu0[0], rest_cpu_s=cpu1[1] - cpu0[1],
                         load_generator_cpu_s=process_cpu_seconds() - own0)
            windows.append(entry)
        final_state = _status(http, job_id)["state"]
        with contextlib.suppress(httpx.HTTPError):
            http.delete(f"/v1/jobs/{job_id}")
    finally:
        http.close()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.pid, 9)

    commits = _commits(output)
    shutil.rmtree(work, ignore_errors=True)  # GBs of shards; kept only when a run fails
    for entry in windows:
        tokens = _tokens_between(commits, entry["start"], entry["end"])
        entry["tokens"] = tokens
        entry["tokens_per_s"] = tokens / (entry["end"] - entry["start"])
    quiet = [w for w in windows if w["kind"] == "quiet"]
    load = [w for w in windows if w["kind"] == "load"]

    def rate(ws: list[dict[str, Any]]) -> float:
        return sum(w["tokens"] for w in ws) / sum(w["end"] - w["start"] for w in ws)

    rate_ratio = ratio(rate(load), rate(quiet))
    paired = [ratio(windows[i]["tokens_per_s"],
                    (windows[i - 1]["tokens_per_s"] + windows[i + 1]["tokens_per_s"]) / 2)
              for i in range(1, len(windows) - 1, 2)]
    latencies = [ms for w in load for ms in w.pop("latencies_ms")]
    errors = sum(w["errors"] for w in load)
    p99 = _pct(latencies, 0.99)
    sse_p99 = max((w["sse_age_p99_ms"] or 0.0) for w in load)
    loads = [x for w in windows for x in (w["loadavg_start"][0], w["loadavg_end"][0])]
    requests = sum(w["requests"] for w in load)
    coord_cpu_load = sum(w["coordinator_cpu_s"] for w in load)
    coord_cpu_quiet = sum(w["coordinator_cpu_s"] for w in quiet)
    payload = {
        "label": args.label, "note": args.note, "quick": args.quick,
        "pollers": args.pollers, "followers": args.followers,
        "poll_interval_s": args.poll_interval, "window_s": window, "rounds": rounds,
        "samples": samples, "unit_tokens": 2048, "job_state_at_end": final_state,
        "windows": windows,
        "tokens_per_s": {"quiet": rate(quiet), "load": rate(load)},
        "ratio_tokens_per_s": rate_ratio, "paired_ratios": paired,
        "requests": requests, "errors": errors,
        "p50_ms": _pct(latencies, 0.5), "p99_ms": p99, "max_ms": max(latencies, default=None),
        "sse_events": sum(w["sse_events"] for w in load), "sse_age_p99_ms": sse_p99,
        "load_generator_cpu_s_per_window": (
            sum(w["load_generator_cpu_s"] for w in load) / len(load)),
        "engine_and_ray_cpu_s_per_window": {
            "quiet": sum(w["rest_cpu_s"] for w in quiet) / len(quiet),
            "load": sum(w["rest_cpu_s"] for w in load) / len(load)},
        "coordinator_cpu_ms_per_request": (
            1000 * (coord_cpu_load - coord_cpu_quiet * len(load) / len(quiet)) / requests
            if requests else None),
        "loadavg_1m": {"min": min(loads), "max": max(loads),
                       "median": statistics.median(loads)},
        "profile": profile,
        "targets": TARGETS,
        "verdicts": {
            "errors": "PASS" if errors == 0 else "MISS",
            "p99": "PASS" if p99 is not None and p99 < TARGETS["p99_ms"] else "MISS",
            "ratio": verdict(rate_ratio, TARGETS["tokens_per_s_ratio"]),
        },
    }
    if final_state != "running":
        # A window after the job's end would count as slowness: no result from this run.
        raise SystemExit(f"the job was {final_state} before the last window ended: nothing "
                         f"saved; run again with more --samples (now {samples})")
    section = "api_polling" + (f"-{args.label}" if args.label else "")
    save_section(args.out, section, payload, machine_info())
    print(table(
        ["measure", "value", "target", "verdict"],
        [
            ["errors", f"{errors} of {requests} requests + {payload['sse_events']} events",
             0, payload["verdicts"]["errors"]],
            ["p50 latency ms", payload["p50_ms"], "-", "-"],
            ["p99 latency ms", p99, "< 100", payload["verdicts"]["p99"]],
            ["SSE event age p99 ms", sse_p99, "-", "-"],
            ["coordinator CPU ms per request", payload["coordinator_cpu_ms_per_request"],
             "-", "-"],
            ["load generator CPU s per load window",
             payload["load_generator_cpu_s_per_window"], "-", "-"],
            ["engine + Ray CPU s per window (quiet / load)",
             "{quiet:.1f} / {load:.1f}".format(**payload["engine_and_ray_cpu_s_per_window"]),
             "-", "-"],
            ["tokens/s quiet", rate(quiet), "-", "-"],
            ["tokens/s under load", rate(load), "-", "-"],
            ["ratio (paired: " + ", ".join(f"{p:.3f}" for p in paired if p) + ")",
             rate_ratio, ">= 0.95", payload["verdicts"]["ratio"]],
            ["load average 1m (min-max)", f"{min(loads):.2f}-{max(loads):.2f}", "-", "-"],
        ],
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
