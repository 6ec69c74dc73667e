"""The coordinator's durable memory: jobs, units, attempts and commits, in SQLite (WAL).

The output location is the truth about what is done (its commit records); the ledger is
what the coordinator needs to answer quickly and to resume: which jobs exist, in which
order they queue, their specs and states, the history of attempts, and what a job's page
shows after the job has ended (its numbers, its throughput curve, its workers' totals).
After a crash it is reconciled from the outputs (`Scheduler.start`).

One connection per thread (sqlite3 objects are not shared across threads). Writes that
decide something (a job inserted, a state change, a plan) are one short transaction
each, done before the call returns. The bookkeeping of a running job (unit commits and
failures, restarts, throughput points, totals) is written behind: queued in memory and
applied in one transaction at most `write_interval` seconds later by a writer thread,
so the thread that drives the engines never waits on SQLite. Every read and every
deciding write first applies what is queued, so the ledger always reads its own writes;
a crash loses at most `write_interval` seconds of bookkeeping, which the reconcile with
the outputs repairs where it matters (which units are committed).

**One coordinator per ledger: the lease.** Two coordinators on one ledger would both
take queued jobs, and neither would know when the other's runner died. The `lease` table
holds one row: who holds the ledger (host, pid, address, since when), until when, and an
`epoch` that grows by one at every take-over. `acquire` takes the lease when nobody holds
it, or when the holder is gone: its lease expired (no heartbeat for `ttl` seconds), or
it was a process on this host that no longer runs (a pid checked with its start time,
so a reused pid is not mistaken for it) — then a successor takes over at once instead of
waiting for the expiry. Otherwise `acquire` raises `LedgerHeld`, naming the holder. The
holder calls `renew` every few seconds.

The epoch is a fencing token: once a ledger has asked for the lease, every write that
changes something (each transaction, and each batch written behind) first checks, inside
the same SQLite transaction, that the lease still carries its epoch, and raises
`LeaseLost` otherwise. A coordinator that stalled past its expiry and was taken over
therefore cannot change a job when it wakes up: its writes fail, and it steps down
(scheduler.py). A ledger that never asked (tests, tools) is not fenced.

SQLite's WAL mode needs shared memory between its users, so a ledger is only ever shared
by processes of one host (or containers sharing a volume, which see different hostnames
and pids: for them the expiry alone decides).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sqlite3
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.output.local_storage import (
    OUTPUT_MODE_ENV,
    make_output_dirs,
    output_file_mode,
    output_opener,
)
from hsx.spec import JobSpec, TrainSpec
from hsx.wire import JobState, TrainState
from hsx_service.processes import process_alive, process_start

logger = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    spec TEXT NOT NULL,
    output TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    last_error TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0,
    owner TEXT                       -- the submitting user (users.py); NULL before users
);
CREATE TABLE IF NOT EXISTS units (
    job_id TEXT NOT NULL,
    unit INTEGER NOT NULL,
    row_start INTEGER NOT NULL,
    row_end INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    state TEXT NOT NULL,             -- pending | running | committed | failed
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    PRIMARY KEY (job_id, unit)
);
CREATE TABLE IF NOT EXISTS attempts (
    job_id TEXT NOT NULL,
    unit INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    at REAL NOT NULL,
    outcome TEXT NOT NULL,           -- committed | duplicate | failed
    error TEXT
);
CREATE TABLE IF NOT EXISTS commits (
    job_id TEXT NOT NULL,
    unit INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    failed INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    seconds REAL NOT NULL,
    PRIMARY KEY (job_id, unit)
);
CREATE TABLE IF NOT EXISTS throughput (
    job_id TEXT NOT NULL,
    at REAL NOT NULL,                -- Unix time
    tokens_per_s REAL NOT NULL,      -- over the interval ending here
    tokens_done INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS throughput_job ON throughput (job_id, at);
CREATE TABLE IF NOT EXISTS job_totals (
    job_id TEXT PRIMARY KEY,
    totals TEXT NOT NULL,            -- JSON: JobTotals
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS worker_totals (
    job_id TEXT NOT NULL,
    worker TEXT NOT NULL,
    units INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    seconds REAL NOT NULL,
    PRIMARY KEY (job_id, worker)
);
CREATE TABLE IF NOT EXISTS lease (
    name TEXT PRIMARY KEY,           -- 'coordinator': one holder per ledger
    epoch INTEGER NOT NULL,          -- +1 at every take-over: the fencing token
    holder TEXT NOT NULL,            -- random id of the holding Ledger object
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    pid_started TEXT,                -- the process's start time, where the OS tells it
    address TEXT,                    -- where the holder serves its API
    since REAL NOT NULL,             -- Unix time it took the lease
    renewed_at REAL NOT NULL,
    expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS trainings (
    job_id TEXT PRIMARY KEY,
    spec TEXT NOT NULL,              -- TrainSpec JSON
    state TEXT NOT NULL,             -- TrainState
    error TEXT,
    restarts INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
"""


@dataclass
class JobRow:
    seq: int
    id: str
    spec: JobSpec
    output: str
    state: JobState
    created_at: float
    started_at: float | None
    finished_at: float | None
    last_error: str | None
    cancel_requested: bool
    restarts: int
    owner: str | None = None


Statement = tuple[str, tuple[Any, ...]]

LEASE = "coordinator"


class LedgerHeld(RuntimeError):
    """Another coordinator holds the ledger's lease (and is alive)."""

    def __init__(self, path: Path, holder: LeaseHolder):
        self.path = path
        self.holder = holder
        super().__init__(
            f"the ledger {path} is held by {holder.describe()}; two coordinators on one "
            "ledger would run the same jobs. Use that coordinator, stop it, choose another "
            "ledger (--ledger / HSX_LEDGER_PATH), or start this one with --standby to take "
            "over when it stops"
        )


class LeaseLost(RuntimeError):
    """A write refused because this ledger no longer holds the lease (it was fenced)."""


@dataclass(frozen=True)
class LeaseHolder:
    """The lease row: who holds the ledger, and until when."""

    epoch: int
    holder: str
    host: str
    pid: int
    pid_started: str | None
    address: str | None
    since: float
    renewed_at: float
    expires_at: float

    def gone(self, now: float | None = None) -> bool:
        """The holder stopped renewing (expired), or was a process here that is gone."""
        if self.expires_at <= (time.time() if now is None else now):
            return True
        return self.host == socket.gethostname() and not process_alive(
            self.pid, self.pid_started)

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        where = f" serving {self.address}" if self.address else ""
        return (f"the coordinator with pid {self.pid} on host {self.host}{where}, "
                f"since {since} (lease renewed {max(time.time() - self.renewed_at, 0):.0f} s "
                "ago)")


def _create_ledger_file(path: Path) -> None:
    """Create the ledger's file with the outputs' mode (HSX_OUTPUT_MODE, owner-only by
    default) before SQLite opens it: SQLite would make it 0644 less the umask, and it
    gives the -wal and -shm files the database's own mode. The ledger holds every job's
    spec (paths, models, datasets) and its lease."""
    try:
        os.close(output_opener(path, os.O_RDWR | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        mode, wanted = stat.S_IMODE(path.stat().st_mode), output_file_mode()
        if mode & ~wanted:  # made by an older hsx, or by hand: the operator decides
            logger.warning("%s has mode %o, more open than the %o %s gives new files",
                           path, mode, wanted, OUTPUT_MODE_ENV)


def _lease_row(row: sqlite3.Row) -> LeaseHolder:
    return LeaseHolder(
        epoch=int(row["epoch"]), holder=row["holder"], host=row["host"], pid=int(row["pid"]),
        pid_started=row["pid_started"], address=row["address"], since=float(row["since"]),
        renewed_at=float(row["renewed_at"]), expires_at=float(row["expires_at"]),
    )


class Ledger:
    def __init__(self, path: str | Path, write_interval: float = 0.5):
        self.path = Path(path).expanduser()
        make_output_dirs(self.path.parent)
        _create_ledger_file(self.path)
        self.write_interval = write_interval
        self._local = threading.local()
        self._pending: list[Statement] = []
        self._pending_lock = threading.Lock()
        self._flush_lock = threading.Lock()  # batches are applied one at a time, in order
        self._writer: threading.Thread | None = None
        self._closing = threading.Event()
        # The lease (see the module docstring): once asked for, writes are fenced.
        self._leased = False
        self._epoch: int | None = None
        self._holder_id = uuid.uuid4().hex
        self._lost_reported = False
        # executescript manages its own transaction.
        self._conn().executescript(SCHEMA)
        columns = {row["name"] for row in self._conn().execute("PRAGMA table_info(jobs)")}
        if "owner" not in columns:  # a ledger from before jobs had owners: theirs are NULL
            self._conn().execute("ALTER TABLE jobs ADD COLUMN owner TEXT")

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
        return conn

    @contextmanager
    def _transaction(self, fenced: bool = True) -> Iterator[sqlite3.Connection]:
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            if fenced and self._leased:
                self._check_lease(db)
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _check_lease(self, db: sqlite3.Connection) -> None:
        """Inside a write transaction: raise LeaseLost unless this ledger holds the lease."""
        row = db.execute("SELECT * FROM lease WHERE name = ?", (LEASE,)).fetchone()
        if self._epoch is not None and row is not None and int(row["epoch"]) == self._epoch:
            return
        held = _lease_row(row).describe() if row is not None else "nobody"
        if self._epoch is None:
            raise LeaseLost(f"this coordinator does not hold the ledger; it is held by {held}")
        self._epoch = None
        raise LeaseLost(f"this coordinator's lease on the ledger was taken over; it is now "
                        f"held by {held}")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """A write that decides something: what is queued goes first, then this."""
        self.flush()
        with self._transaction() as db:
            yield db

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        # Queued writes of a fenced coordinator are dropped (LeaseLost); reads go on.
        with contextlib.suppress(LeaseLost):
            self.flush()
        return self._conn().execute(sql, params)

    # ---------------------------------------------------------------- the lease

    @property
    def holds_lease(self) -> bool:
        """Whether this ledger holds the lease, as far as its last acquire/renew knew."""
        return self._epoch is not None

    def lease(self) -> LeaseHolder | None:
        """The lease row as it is now (None: never taken, or released)."""
        row = self._conn().execute("SELECT * FROM lease WHERE name = ?", (LEASE,)).fetchone()
        return _lease_row(row) if row is not None else None

    def acquire(self, ttl: float, address: str | None = None) -> LeaseHolder:
        """Take the lease (see the module docstring); raise LedgerHeld if it is held.

        From the first call on, this ledger's writes are fenced by the lease.
        """
        self._leased = True
        now = time.time()
        with self._transaction(fenced=False) as db:
            row = db.execute("SELECT * FROM lease WHERE name = ?", (LEASE,)).fetchone()
            current = _lease_row(row) if row is not None else None
            if current is not None and current.holder != self._holder_id and not current.gone(now):
                raise LedgerHeld(self.path, current)
            epoch = (current.epoch if current is not None else 0) + 1
            db.execute(
                "INSERT OR REPLACE INTO lease (name, epoch, holder, host, pid, pid_started, "
                "address, since, renewed_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (LEASE, epoch, self._holder_id, socket.gethostname(), os.getpid(),
                 process_start(os.getpid()), address, now, now, now + ttl),
            )
        if current is not None and current.holder != self._holder_id:
            logger.warning("took over the ledger %s from %s", self.path, current.describe())
        self._epoch = epoch
        self._lost_reported = False
        holder = self.lease()
        if holder is None:
            raise RuntimeError(f"ledger: the lease of {self.path} vanished after acquire")
        return holder

    def renew(self, ttl: float) -> None:
        """Extend the lease by `ttl` from now; LeaseLost if it was taken over."""
        now = time.time()
        with self._transaction(fenced=True) as db:
            db.execute("UPDATE lease SET renewed_at = ?, expires_at = ? WHERE name = ?",
                       (now, now + ttl, LEASE))

    def release(self) -> None:
        """Give the lease up (a clean stop): a successor need not wait for its expiry."""
        if self._epoch is None:
            return
        with self._transaction(fenced=False) as db:
            db.execute("DELETE FROM lease WHERE name = ? AND epoch = ?", (LEASE, self._epoch))
        self._epoch = None

    # ---------------------------------------------------------------- write-behind

    def _defer(self, *statements: Statement) -> None:
        """Queue bookkeeping writes; the writer thread applies them within write_interval."""
        if self._leased and self._epoch is None:
            return  # not the holder: the writes would be refused anyway
        with self._pending_lock:
            self._pending.extend(statements)
            writer = self._writer
            if writer is None and not self._closing.is_set():
                writer = self._writer = threading.Thread(
                    target=self._write_behind, name="hsx-ledger-writer", daemon=True)
                writer.start()
        if writer is None:  # closed: nobody will come back for them
            self.flush()

    def _write_behind(self) -> None:
        while not self._closing.wait(self.write_interval):
            try:
                self.flush()
            except LeaseLost as err:
                if not self._lost_reported:
                    self._lost_reported = True
                    logger.warning("ledger: bookkeeping writes dropped: %s", err)
            except sqlite3.Error:
                logger.exception("ledger: a batch of bookkeeping writes failed")

    def flush(self) -> None:
        """Apply the queued writes now, in this thread, in one transaction."""
        with self._flush_lock:
            with self._pending_lock:
                batch, self._pending = self._pending, []
            if not batch:
                return
            with self._transaction() as db:
                for sql, params in batch:
                    db.execute(sql, params)

    def close(self) -> None:
        """Stop the writer thread after applying everything queued; give up the lease."""
        self._closing.set()
        writer = self._writer
        if writer is not None:
            writer.join(timeout=10)
        try:
            self.flush()
        except LeaseLost as err:  # a fenced coordinator stopping: its writes are void
            logger.warning("ledger: bookkeeping writes dropped at close: %s", err)
        finally:
            self.release()

    # ---------------------------------------------------------------- trainings

    def put_training(self, job_id: str, spec: TrainSpec) -> TrainRow:
        """Record a (new or restarted) training of `job_id`, state `starting`."""
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO trainings (job_id, spec, state, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT(job_id) DO UPDATE SET spec = excluded.spec, "
                "state = excluded.state, error = NULL, updated_at = excluded.updated_at",
                (job_id, spec.model_dump_json(), TrainState.starting.value, now, now),
            )
        row = self.training(job_id)
        if row is None:
            raise RuntimeError(f"ledger: training of {job_id} vanished after insert")
        return row

    def training(self, job_id: str) -> TrainRow | None:
        row = self._read(
            "SELECT * FROM trainings WHERE job_id = ?", (job_id,)).fetchone()
        return _train_row(row) if row else None

    def trainings(self) -> list[TrainRow]:
        rows = self._read("SELECT * FROM trainings ORDER BY created_at").fetchall()
        return [_train_row(r) for r in rows]

    def set_training(self, job_id: str, state: TrainState, error: str | None = None,
                     restarts: int | None = None) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE trainings SET state = ?, error = ?, updated_at = ?, "
                "restarts = COALESCE(?, restarts) WHERE job_id = ?",
                (state.value, error, time.time(), restarts, job_id),
            )

    # ---------------------------------------------------------------- jobs

    def insert_job(self, job_id: str, spec: JobSpec, output: str,
                   owner: str | None = None) -> JobRow | None:
        """Add a queued job; None if the id exists (the caller compares specs)."""
        with self._tx() as db:
            exists = db.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if exists:
                return None
            db.execute(
                "INSERT INTO jobs (id, spec, output, state, created_at, owner) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, spec.model_dump_json(), output, JobState.queued.value, time.time(),
                 owner),
            )
        row = self.job(job_id)
        if row is None:
            raise RuntimeError(f"ledger: job {job_id} vanished after insert")
        return row

    def job(self, job_id: str) -> JobRow | None:
        row = self._read("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job_row(row) if row else None

    def jobs(self, state: JobState | None = None) -> list[JobRow]:
        if state is None:
            rows = self._read("SELECT * FROM jobs ORDER BY seq").fetchall()
        else:
            rows = self._read(
                "SELECT * FROM jobs WHERE state = ? ORDER BY seq", (state.value,)
            ).fetchall()
        return [_job_row(r) for r in rows]

    def next_queued(self) -> JobRow | None:
        row = self._read(
            "SELECT * FROM jobs WHERE state = ? ORDER BY seq LIMIT 1", (JobState.queued.value,)
        ).fetchone()
        return _job_row(row) if row else None

    def set_state(self, job_id: str, state: JobState, error: str | None = None) -> None:
        now = time.time()
        with self._tx() as db:
            if state == JobState.running:
                db.execute(
                    "UPDATE jobs SET state = ?, started_at = COALESCE(started_at, ?), "
                    "last_error = COALESCE(?, last_error) WHERE id = ?",
                    (state.value, now, error, job_id),
                )
            elif state.finished:
                db.execute(
                    "UPDATE jobs SET state = ?, finished_at = ?, "
                    "last_error = COALESCE(?, last_error) WHERE id = ?",
                    (state.value, now, error, job_id),
                )
            else:
                db.execute(
                    "UPDATE jobs SET state = ?, last_error = COALESCE(?, last_error) WHERE id = ?",
                    (state.value, error, job_id),
                )

    def set_error(self, job_id: str, error: str) -> None:
        """The job's last error (written behind)."""
        self._defer(("UPDATE jobs SET last_error = ? WHERE id = ?", (error, job_id)))

    def request_cancel(self, job_id: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))

    def add_restart(self, job_id: str) -> None:
        """One more worker restart (written behind)."""
        self._defer(("UPDATE jobs SET restarts = restarts + 1 WHERE id = ?", (job_id,)))

    # ---------------------------------------------------------------- units

    def plan(self, job_id: str, units: list[tuple[int, int, int, int]]) -> None:
        """Record a job's units (unit, row_start, row_end, tokens), once."""
        with self._tx() as db:
            db.executemany(
                "INSERT OR IGNORE INTO units (job_id, unit, row_start, row_end, tokens, state) "
                "VALUES (?, ?, ?, ?, ?, 'pending')",
                [(job_id, *u) for u in units],
            )

    def reconcile_units(self, job_id: str, committed: set[int]) -> None:
        """Make units agree with the output: committed there means committed here;
        anything that was running when the coordinator died is pending again."""
        with self._tx() as db:
            for unit in committed:
                db.execute(
                    "UPDATE units SET state = 'committed' WHERE job_id = ? AND unit = ?",
                    (job_id, unit),
                )
            db.execute(
                "UPDATE units SET state = 'pending' WHERE job_id = ? AND state = 'running'",
                (job_id,),
            )

    def unit_committed(self, job_id: str, report: Any) -> None:
        """A unit's attempt ended with its commit record (a UnitReport; written behind).

        The worker's totals count the units it won (a duplicate's data was discarded).
        """
        outcome = "committed" if report.won else "duplicate"
        statements: list[Statement] = [
            ("UPDATE units SET state = 'committed', attempts = attempts + 1 "
             "WHERE job_id = ? AND unit = ?", (job_id, report.unit)),
            ("INSERT INTO attempts (job_id, unit, attempt, at, outcome) "
             "SELECT ?, ?, attempts, ?, ? FROM units WHERE job_id = ? AND unit = ?",
             (job_id, report.unit, time.time(), outcome, job_id, report.unit)),
            ("INSERT OR REPLACE INTO commits "
             "(job_id, unit, samples, failed, tokens, bytes, seconds) "
             "VALUES (?, ?, ?, ?, ?, ?, ?)",
             (job_id, report.unit, report.samples, len(report.errors), report.tokens,
              report.bytes, report.seconds)),
        ]
        if report.won:
            statements.append((
                "INSERT INTO worker_totals (job_id, worker, units, samples, tokens, bytes, "
                "seconds) VALUES (?, ?, 1, ?, ?, ?, ?) ON CONFLICT (job_id, worker) DO UPDATE "
                "SET units = units + 1, samples = samples + excluded.samples, "
                "tokens = tokens + excluded.tokens, bytes = bytes + excluded.bytes, "
                "seconds = seconds + excluded.seconds",
                (job_id, report.worker or "?", report.samples, report.tokens, report.bytes,
                 report.seconds)))
        self._defer(*statements)

    def unit_failed(self, job_id: str, unit: int, attempt: int, error: str, gave_up: bool) -> None:
        """An attempt of a unit failed; `gave_up` after the last one (written behind)."""
        self._defer(
            ("UPDATE units SET state = ?, attempts = ?, last_error = ? "
             "WHERE job_id = ? AND unit = ?",
             ("failed" if gave_up else "pending", attempt, error, job_id, unit)),
            ("INSERT INTO attempts (job_id, unit, attempt, at, outcome, error) "
             "VALUES (?, ?, ?, ?, 'failed', ?)",
             (job_id, unit, attempt, time.time(), error)),
        )

    def failed_units(self, job_id: str) -> list[tuple[int, int, int, str]]:
        """(unit, row_start, row_end, last_error) of units given up."""
        rows = self._read(
            "SELECT unit, row_start, row_end, last_error FROM units "
            "WHERE job_id = ? AND state = 'failed' ORDER BY unit",
            (job_id,),
        ).fetchall()
        return [(r["unit"], r["row_start"], r["row_end"], r["last_error"] or "") for r in rows]

    def unit_seconds(self) -> tuple[float, int]:
        """Sum and count of unit durations, over every job."""
        row = self._read("SELECT COALESCE(SUM(seconds), 0), COUNT(*) FROM commits")
        total, count = row.fetchone()
        return float(total), int(count)

    # ---------------------------------------------------------------- what a job page shows

    def add_throughput(self, job_id: str, at: float, tokens_per_s: float,
                       tokens_done: int) -> None:
        """One point of the job's throughput curve (written behind)."""
        self._defer(("INSERT INTO throughput (job_id, at, tokens_per_s, tokens_done) "
                     "VALUES (?, ?, ?, ?)", (job_id, at, tokens_per_s, tokens_done)))

    def throughput(self, job_id: str) -> list[tuple[float, float, int]]:
        """The job's throughput curve: (Unix time, tokens/s, tokens done), in time order."""
        rows = self._read(
            "SELECT at, tokens_per_s, tokens_done FROM throughput WHERE job_id = ? ORDER BY at",
            (job_id,),
        ).fetchall()
        return [(float(r[0]), float(r[1]), int(r[2])) for r in rows]

    def put_totals(self, job_id: str, totals: dict[str, Any]) -> None:
        """The job's numbers as last seen (a JSON object; written behind)."""
        self._defer(("INSERT OR REPLACE INTO job_totals (job_id, totals, updated_at) "
                     "VALUES (?, ?, ?)", (job_id, json.dumps(totals), time.time())))

    def totals(self) -> dict[str, dict[str, Any]]:
        """Every job's numbers as last put, by job id."""
        rows = self._read("SELECT job_id, totals FROM job_totals").fetchall()
        return {r["job_id"]: json.loads(r["totals"]) for r in rows}

    def worker_totals(self, job_id: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """Per worker: units, samples, tokens, bytes and seconds it committed, by job id."""
        sql = "SELECT * FROM worker_totals"
        rows = self._read(sql + " WHERE job_id = ? ORDER BY worker", (job_id,)).fetchall() \
            if job_id is not None else self._read(sql + " ORDER BY job_id, worker").fetchall()
        out: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            out.setdefault(r["job_id"], []).append({
                "name": r["worker"], "units": int(r["units"]), "samples": int(r["samples"]),
                "tokens": int(r["tokens"]), "bytes": int(r["bytes"]),
                "seconds": float(r["seconds"])})
        return out


@dataclass
class TrainRow:
    job_id: str
    spec: TrainSpec
    state: TrainState
    error: str | None
    restarts: int
    created_at: float
    updated_at: float


def _train_row(row: sqlite3.Row) -> TrainRow:
    return TrainRow(
        job_id=row["job_id"], spec=TrainSpec.model_validate_json(row["spec"]),
        state=TrainState(row["state"]), error=row["error"], restarts=int(row["restarts"]),
        created_at=float(row["created_at"]), updated_at=float(row["updated_at"]),
    )


def _job_row(row: sqlite3.Row) -> JobRow:
    return JobRow(
        seq=row["seq"],
        id=row["id"],
        spec=JobSpec.model_validate(json.loads(row["spec"])),
        output=row["output"],
        state=JobState(row["state"]),
        created_at=row["created_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        last_error=row["last_error"],
        cancel_requested=bool(row["cancel_requested"]),
        restarts=row["restarts"],
        owner=row["owner"],
    )
