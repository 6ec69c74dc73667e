"""`Output`: an hsx output location, and everything hsx reads from or writes into it.

Every reader and writer goes through `Output(uri)` (a path, `file://`, `s3://`, `gs://`
or `az://` URI): the job driver (manifest, orphans, totals, the complete marker),
ingestion (the inputs and errors tables), workers (input rows, shard writers),
`HiddenStatesDataset`, the trainer, the exporter, the scheduler and the CLI. The layout
is the same on local disk and on object stores (docs/FORMAT.md); `Storage` underneath
does the few operations that differ.

An `Output` pickles as its storage (Ray actors, DataLoader workers get their own
connections); what it caches (the manifest, the inputs table's reader) is rebuilt there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from hsx.output.layout import (
    COMMITS_DIR,
    COMPLETE,
    ERRORS,
    INGEST,
    INPUTS,
    INPUTS_DIR,
    MANIFEST,
    REGENERATIONS_DIR,
    SHARDS_DIR,
    commit_path,
    errors_part_path,
    inputs_part_path,
    part_record_path,
    regenerations_path,
    unit_of_key,
)
from hsx.output.records import (
    CommitRecord,
    IngestRecord,
    Manifest,
    OutputCorrupt,
    PartRecord,
    RegenerationsRef,
    SampleError,
)
from hsx.output.shards import ShardCorrupt, ShardReader, ShardWriter, verify_shard
from hsx.output.storage import ObjectExistsError, Storage, StorageError
from hsx.output.tables import (
    ERRORS_SCHEMA,
    INPUTS_SCHEMA,
    REGENERATE_KEY,
    REGENERATIONS_SCHEMA,
    TableRows,
    TableWriter,
    inputs_schema,
    read_table,
)
from hsx.progress import JobProgress

logger = logging.getLogger(__name__)

_COMMIT_NAME = re.compile(r"^unit-(\d{6,})\.json$")
_PART_RECORD = re.compile(rf"^{INPUTS_DIR}/part-(\d{{5,}})\.json$")
_KEEP_PARTS = 4  # inputs parts whose readers an Output keeps (a unit spans one or two)
_READ_THREADS = 8  # commit records fetched side by side from an object store


class OutputNotFound(FileNotFoundError):
    """No hsx output at the location (it has no manifest)."""


@dataclass(frozen=True)
class BadShard:
    """A committed unit whose shard (or commit record) fails its checks."""

    unit: int
    shard: str  # the shard's URL (or the commit record's, when that cannot be read)
    reason: str


@dataclass(frozen=True)
class OutputTotals:
    """What an output holds, counted from its manifest and commit records."""

    samples_total: int  # good samples planned (rows of inputs.arrow)
    tokens_total: int
    units_total: int
    units_done: int  # = shards
    samples: int  # committed samples, with hidden states
    tokens: int
    bytes: int
    unit_errors: int  # samples a worker could not extract (commit records' errors)
    ingest_errors: int  # rows refused at ingestion
    generated: int = 0  # samples whose conversation was regenerated (regenerate:)
    generated_tokens: int = 0
    samples_checked: int = 0  # by the self-check (commit records' checks)
    check_problems: int = 0
    head_rows_checked: int = 0
    head_rows_agreed: int = 0

    @property
    def errors(self) -> int:
        return self.unit_errors + self.ingest_errors

    def progress(self) -> JobProgress:
        """The numbers as job progress: what earlier runs committed counts as done."""
        return JobProgress(
            samples_total=self.samples_total,
            tokens_total=self.tokens_total,
            samples_done=self.samples + self.unit_errors,
            tokens_done=self.tokens,
            samples_failed=self.errors,
            shards=self.units_done,
            bytes=self.bytes,
            units_total=self.units_total,
            units_done=self.units_done,
            samples_generated=self.generated,
            tokens_generated=self.generated_tokens,
            samples_checked=self.samples_checked,
            check_problems=self.check_problems,
            head_rows_checked=self.head_rows_checked,
            head_rows_agreed=self.head_rows_agreed,
            rows_tokenized=self.samples_total + self.ingest_errors,
            rows_total=self.samples_total + self.ingest_errors,
        )


def unit_of_commit_key(key: str) -> int | None:
    """The unit a key under commits/ is the record of, or None for any other key."""
    folder, _, name = key.rpartition("/")
    m = _COMMIT_NAME.match(name)
    return int(m.group(1)) if m and folder == COMMITS_DIR else None


class Output:
    """One output location; see the module docstring."""

    def __init__(self, uri: str | os.PathLike[str] | Storage, **options: Any) -> None:
        """`uri`: a path or URI (`options` go to `Storage.for_uri`), or a Storage."""
        if isinstance(uri, Storage):
            if options:
                raise ValueError("options are for a URI, not for a Storage")
            self.storage = uri
        else:
            text = os.fspath(uri)
            if "://" not in text:
                text = os.path.expanduser(text)
            self.storage = Storage.for_uri(text, **options)
        self._init_caches()

    def _init_caches(self) -> None:
        self._manifest: Manifest | None = None
        self._inputs: TableRows | None = None
        self._rows_per_part: int | None = None  # 0: whole tables (inputs.arrow)
        self._part_rows: dict[int, TableRows] = {}

    @classmethod
    def of(cls, output: Output | str | os.PathLike[str]) -> Output:
        """`output` itself if it is an Output, else the Output at that URI."""
        return output if isinstance(output, Output) else cls(output)

    def __getstate__(self) -> dict[str, Any]:
        return {"storage": self.storage}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.storage = state["storage"]
        self._init_caches()

    def __repr__(self) -> str:
        return f"Output({self.uri!r})"

    @property
    def uri(self) -> str:
        """The location as a URI (`file:///...` on local disk)."""
        return self.storage.uri

    @property
    def local_root(self) -> Path | None:
        """The folder on local disk, or None on an object store."""
        path = self.storage.local_path(MANIFEST)
        return None if path is None else path.parent

    @property
    def location(self) -> str:
        """A name that two spellings of one location share (symlinks resolved on disk)."""
        root = self.local_root
        return str(root.resolve()) if root is not None else self.uri

    def __str__(self) -> str:
        root = self.local_root
        return str(root) if root is not None else self.uri

    def url(self, key: str) -> str:
        return self.storage.url(key)

    # ------------------------------------------------------------------ manifest

    def read_manifest(self) -> Manifest | None:
        """The manifest, or None when there is none (yet). Read once, then kept."""
        if self._manifest is None:
            try:
                data = self.storage.read(MANIFEST)
            except FileNotFoundError:
                return None
            self._manifest = Manifest.parse(data, self.url(MANIFEST))
        return self._manifest

    def manifest(self) -> Manifest:
        """The manifest; OutputNotFound (naming the location) when there is none."""
        manifest = self.read_manifest()
        if manifest is None:
            raise OutputNotFound(f"no hsx output at {self}: {self.url(MANIFEST)} does not exist")
        return manifest

    def holds_job(self) -> bool:
        """Whether a job began here: its manifest, or the record of its ingestion."""
        return self.has_manifest() or self.read_ingest_record() is not None

    def has_manifest(self) -> bool:
        return self._manifest is not None or self.storage.exists(MANIFEST)

    def publish_manifest(self, manifest: Manifest) -> Manifest:
        """Publish the manifest once (create-if-absent); the one that is there after.

        When another driver published one first, that one is returned: check it with
        `Manifest.check_same_job` before using it.
        """
        try:
            self.storage.create(MANIFEST, manifest.to_json())
        except ObjectExistsError:
            self._manifest = None
            return self.manifest()
        self._manifest = manifest
        return manifest

    # ------------------------------------------------------------------ tables

    def table_writer(self, name: str, *, messages: bool = False, images: bool = False
                     ) -> TableWriter:
        """A writer of a whole `inputs.arrow` or `errors.arrow` (visible once committed),
        as outputs written before the parts hold them; ingestion writes parts
        (`part_writers`).

        `messages`: the inputs table of a regenerating job also keeps each row's
        conversation (a `messages` column of JSON text); `images`: a job's that takes
        images keeps each row's (an `images` column)."""
        return self._table_writer(name, name, messages, images)

    def _table_writer(self, table: str, key: str, messages: bool, images: bool = False
                      ) -> TableWriter:
        schemas = {INPUTS: INPUTS_SCHEMA, ERRORS: ERRORS_SCHEMA}
        if table not in schemas:
            raise ValueError(f"{table!r} is not a table of an output ({sorted(schemas)})")
        if (messages or images) and table != INPUTS:
            raise ValueError("only the inputs table keeps messages and images")
        schema = (inputs_schema(messages=messages, images=images) if table == INPUTS
                  else schemas[table])
        return TableWriter(self.storage, key, schema)

    def part_writers(self, part: int, *, messages: bool = False, images: bool = False
                     ) -> tuple[TableWriter, TableWriter]:
        """Writers of one part of the inputs and errors tables; `publish_part` after
        both are committed makes the part exist."""
        return (self._table_writer(INPUTS, inputs_part_path(part), messages, images),
                self._table_writer(ERRORS, errors_part_path(part), False))

    def start_ingest(self, record: IngestRecord) -> IngestRecord:
        """Publish ingest.json once (create-if-absent); the one that is there after
        (check it with `IngestRecord.check_same`)."""
        try:
            self.storage.create(INGEST, record.to_json())
        except ObjectExistsError:
            found = self.read_ingest_record()
            if found is None:  # removed between the two calls
                raise
            return found
        return record

    def read_ingest_record(self) -> IngestRecord | None:
        """ingest.json, or None (no ingestion started here, or one older than parts)."""
        try:
            return IngestRecord.parse(self.storage.read(INGEST), self.url(INGEST))
        except FileNotFoundError:
            return None

    def publish_part(self, record: PartRecord) -> None:
        """The part's record, after its tables: the part exists from now on. A record
        already there (another driver ingested the same part: the same bytes) stays."""
        with contextlib.suppress(ObjectExistsError):
            self.storage.create(part_record_path(record.part), record.to_json())

    def part_numbers(self) -> list[int]:
        """The parts that exist (have a record), in order, up to the first missing."""
        found = set()
        for info in self.storage.list(INPUTS_DIR):
            m = _PART_RECORD.match(info.key)
            if m:
                found.add(int(m.group(1)))
        parts: list[int] = []
        while len(parts) in found:
            parts.append(len(parts))
        return parts

    def part_records(self) -> list[PartRecord]:
        """The records of the parts that exist, in order."""
        return [PartRecord.parse(self.storage.read(part_record_path(p)),
                                 self.url(part_record_path(p)))
                for p in self.part_numbers()]

    def part_inputs(self, part: int) -> pa.Table:
        """One part of the inputs table, whole."""
        return read_table(self.storage, inputs_part_path(part))

    def _parts_layout(self) -> int:
        """Rows per inputs part, or 0 when the output holds the tables whole (or holds
        none yet: then the readers say the dataset was not ingested)."""
        if self._rows_per_part is None:
            if self.storage.exists(INPUTS):
                self._rows_per_part = 0
            else:
                record = self.read_ingest_record()
                if record is None:
                    return 0
                self._rows_per_part = record.rows_per_part
        return self._rows_per_part

    def inputs(self) -> pa.Table:
        """The whole inputs table (memory-mapped on local disk): the parts that exist,
        one after the other."""
        if not self._parts_layout():
            return read_table(self.storage, INPUTS)
        tables = [self.part_inputs(p) for p in self.part_numbers()]
        if not tables:
            return INPUTS_SCHEMA.empty_table()
        return pa.concat_tables(tables)

    def input_rows(self, start: int, stop: int) -> pa.Table:
        """Rows [start, stop) of the inputs table; on an object store only their batches
        are read. The readers are kept, so a worker's next unit costs no footer read."""
        per = self._parts_layout()
        if not per:
            if self._inputs is None:
                self._inputs = TableRows(self.storage, INPUTS)
            return self._inputs.slice(start, stop)
        if stop <= start:
            return self._part_reader(start // per).slice(0, 0)
        pieces = []
        for part in range(start // per, (stop - 1) // per + 1):
            first = part * per
            pieces.append(self._part_reader(part).slice(max(start, first) - first,
                                                        min(stop, first + per) - first))
        return pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)

    def _part_reader(self, part: int) -> TableRows:
        reader = self._part_rows.pop(part, None)
        if reader is None:
            reader = TableRows(self.storage, inputs_part_path(part))
        self._part_rows[part] = reader  # most recent last
        while len(self._part_rows) > _KEEP_PARTS:
            del self._part_rows[next(iter(self._part_rows))]
        return reader

    def ingest_errors(self) -> pa.Table:
        """The rows refused at ingestion (an empty table when there were none)."""
        if not self._parts_layout():
            if not self.storage.exists(ERRORS):
                return ERRORS_SCHEMA.empty_table()
            return read_table(self.storage, ERRORS)
        tables = [read_table(self.storage, errors_part_path(r.part))
                  for r in self.part_records() if r.errors]
        return pa.concat_tables(tables) if tables else ERRORS_SCHEMA.empty_table()

    # ------------------------------------------------------------------ regenerations

    def put_regenerations(self, unit: int, attempt: str, table: pa.Table,
                          provenance: Mapping[str, Any]) -> RegenerationsRef:
        """Store one attempt's regenerated conversations of `unit` whole (one object,
        created once); the commit record that names the result makes it visible."""
        table = table.cast(REGENERATIONS_SCHEMA.with_metadata(
            {REGENERATE_KEY: json.dumps(dict(provenance), sort_keys=True).encode()}))
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        data = sink.getvalue().to_pybytes()
        key = regenerations_path(unit, attempt)
        self.storage.create(key, data)
        return RegenerationsRef(
            key=key, sha256=hashlib.sha256(data).hexdigest(), rows=table.num_rows,
            bytes=len(data), tokens=sum(table.column("generated_tokens").to_pylist()),
            truncated=sum(table.column("truncated").to_pylist()))

    def read_regenerations(self, record: CommitRecord) -> pa.Table | None:
        """The regenerated conversations of a committed unit, checked against its
        record (None for a unit of a job that does not regenerate)."""
        ref = record.regenerations
        if ref is None:
            return None
        data = self.storage.read(ref.key)
        if len(data) != ref.bytes or hashlib.sha256(data).hexdigest() != ref.sha256:
            raise OutputCorrupt(f"{self.url(ref.key)} does not match the checksum in the "
                                f"commit record of unit {record.unit}")
        return pa.ipc.open_file(pa.BufferReader(data)).read_all()

    # ------------------------------------------------------------------ commits

    def committed_units(self) -> set[int]:
        """Units with a commit record (cheap: a listing, no record is read)."""
        return {u for info in self.storage.list(COMMITS_DIR)
                if (u := unit_of_commit_key(info.key)) is not None}

    def read_commit(self, unit: int) -> CommitRecord:
        key = commit_path(unit)
        record = CommitRecord.parse(self.storage.read(key), self.url(key))
        if record.unit != unit:
            raise OutputCorrupt(f"{self.url(key)} is the record of unit {record.unit}")
        return record

    def commits(self, skip: Collection[int] = ()) -> list[CommitRecord]:
        """Every commit record, sorted by unit; those of units in `skip` are not read."""
        units = sorted(self.committed_units().difference(skip))
        if self.local_root is not None or len(units) < 2:
            return [self.read_commit(u) for u in units]
        with concurrent.futures.ThreadPoolExecutor(min(_READ_THREADS, len(units))) as pool:
            return list(pool.map(self.read_commit, units))

    # ------------------------------------------------------------------ shards

    def shard_writer(self, unit: int, **options: Any) -> ShardWriter:
        """A ShardWriter of one attempt of `unit` (options as ShardWriter takes them)."""
        return ShardWriter(self.storage, unit, **options)

    def open_shard(self, record: CommitRecord) -> ShardReader:
        """The shard a commit record names, checked against the record and the manifest."""
        reader = ShardReader.open(self.storage, record.shard, record=record)
        layers = self.manifest().layers
        if layers != reader.layers:
            raise ShardCorrupt(
                f"{reader.name}: layers {reader.layers} differ from the manifest's {layers}"
            )
        if len(reader) != record.samples:
            raise ShardCorrupt(
                f"{reader.name}: {len(reader)} samples, its commit record says {record.samples}"
            )
        return reader

    def check_shards(
        self,
        records: Iterable[CommitRecord] | None = None,
        on_checked: Callable[[int], None] | None = None,
    ) -> list[BadShard]:
        """Check every committed shard (or those of `records`): its commit record parses,
        the shard has the record's size and checksums (the whole of it is read), and its
        header agrees with the record and the manifest. Returns the bad ones, by unit;
        where the data checksum fails, the reason names the samples whose own digests
        fail. `on_checked(unit)` is called after each unit (for progress)."""
        bad: list[BadShard] = []
        if records is None:
            found: list[CommitRecord] = []
            for unit in sorted(self.committed_units()):
                try:
                    found.append(self.read_commit(unit))
                except (OutputCorrupt, StorageError, OSError) as err:
                    bad.append(BadShard(unit, self.url(commit_path(unit)), str(err)))
            records = found
        for record in records:
            try:
                verify_shard(self.storage, record)
                self._open_checked(record).close()
            except (OutputCorrupt, StorageError, OSError) as err:
                reason = str(err)
                if "data checksum" in reason:
                    reason += self._bad_samples(record)
                bad.append(BadShard(record.unit, self.url(record.shard), reason))
            if on_checked is not None:
                on_checked(record.unit)
        return sorted(bad, key=lambda b: b.unit)

    def _bad_samples(self, record: CommitRecord) -> str:
        """"; samples ..." naming the samples whose digests fail (empty if none can be)."""
        try:
            reader = self._open_checked(record)
        except (OutputCorrupt, StorageError, OSError):
            return ""
        with reader:
            try:
                failing = [f"{i} (sample_index {int(reader.sample_indices[i])})"
                           for i in reader.failing_samples()]
            except (OutputCorrupt, OSError):
                return ""
        return f"; samples {', '.join(failing)} fail their checksums" if failing else ""

    def _open_checked(self, record: CommitRecord) -> ShardReader:
        """`open_shard`, or where there is no manifest (a bare folder of shards) the
        shard checked against its record alone."""
        if self.read_manifest() is None:
            return ShardReader.open(self.storage, record.shard, record=record)
        return self.open_shard(record)

    def verify(self, records: Iterable[CommitRecord] | None = None) -> int:
        """Check every committed shard as `check_shards` does; returns how many were
        checked. Raises ShardCorrupt naming every shard that fails."""
        records = self.commits() if records is None else list(records)
        bad = self.check_shards(records)
        if bad:
            raise ShardCorrupt(f"{len(bad)} corrupt shard(s): " +
                               "; ".join(b.reason for b in bad))
        return len(records)

    def withdraw(self, units: Iterable[int]) -> list[int]:
        """Take units' commits back, so that a rerun of the job extracts them again:
        complete.json first (the output is no longer complete), then each unit's commit
        record, then its shard. A crash in between leaves at worst a shard no record
        names, which the rerun's `clean_orphans` removes. Only while no job runs on this
        output. Returns the units withdrawn (those that had a commit record)."""
        withdrawn = []
        self.storage.delete(COMPLETE)
        for unit in sorted(set(units)):
            key = commit_path(unit)
            try:
                shard: str | None = self.read_commit(unit).shard
            except FileNotFoundError:
                continue
            except OutputCorrupt:
                shard = None  # an unreadable record: its shard becomes an orphan
            self.storage.delete(key)
            if shard is not None:
                self.storage.delete(shard)
            withdrawn.append(unit)
            logger.warning("%s: unit %d withdrawn (its commit record and shard removed)",
                           self, unit)
        return withdrawn

    # ------------------------------------------------------------------ totals, errors

    def totals(self, records: Iterable[CommitRecord] | None = None, *,
               manifest: Manifest | None = None) -> OutputTotals:
        """The output's numbers (from `records` when given, else every commit record),
        against `manifest` when given (a plan still growing), else the output's."""
        manifest = manifest or self.manifest()
        records = self.commits() if records is None else list(records)
        return OutputTotals(
            samples_total=manifest.num_samples,
            tokens_total=manifest.tokens_total,
            units_total=len(manifest.units),
            units_done=len(records),
            samples=sum(r.samples for r in records),
            tokens=sum(r.tokens for r in records),
            bytes=sum(r.bytes for r in records),
            unit_errors=sum(len(r.errors) for r in records),
            ingest_errors=manifest.num_errors,
            generated=sum(r.regenerations.rows for r in records if r.regenerations),
            generated_tokens=sum(r.regenerations.tokens for r in records if r.regenerations),
            samples_checked=sum(r.checks.samples for r in records if r.checks),
            check_problems=sum(r.checks.problems for r in records if r.checks),
            head_rows_checked=sum(r.checks.head_rows for r in records if r.checks),
            head_rows_agreed=sum(r.checks.head_agreed for r in records if r.checks),
        )

    def errors(
        self,
        records: Iterable[CommitRecord] | None = None,
        given_up: Iterable[tuple[int, int, str]] = (),
    ) -> list[SampleError]:
        """Every sample without hidden states and why, by sample_index: rows refused at
        ingestion, samples workers could not extract (commit records; `records` when
        given, else all), and the samples of units given up (`given_up`: inputs.arrow
        row ranges [start, stop) with the reason, which the job driver knows)."""
        reasons: dict[int, str] = {}
        table = self.ingest_errors()
        for index, reason in zip(table.column("sample_index").to_pylist(),
                                 table.column("reason").to_pylist(), strict=True):
            reasons[int(index)] = str(reason)
        for record in self.commits() if records is None else records:
            for err in record.errors:
                reasons[err.sample_index] = err.reason
        for start, stop, reason in given_up:
            for index in self.input_rows(start, stop).column("sample_index").to_pylist():
                reasons[int(index)] = reason
        return [SampleError(sample_index=i, reason=r) for i, r in sorted(reasons.items())]

    # ------------------------------------------------------------------ complete marker

    def is_complete(self) -> bool:
        """True once every unit is committed (complete.json exists): nothing changes now."""
        return self.storage.exists(COMPLETE)

    def mark_complete(self, summary: Mapping[str, Any]) -> bool:
        """Publish complete.json (once; False if it was there already)."""
        try:
            self.storage.create(COMPLETE, (json.dumps(dict(summary), indent=1) + "\n").encode())
        except ObjectExistsError:
            return False
        return True

    # ------------------------------------------------------------------ housekeeping

    def check_writable(self) -> None:
        """StorageError, naming the location and the problem, unless it can be written."""
        self.storage.check_writable()

    def clean_orphans(self, *, final: bool = False) -> int:
        """Remove what losing or crashed attempts left: their shards and unfinished
        writes (multipart uploads, staging files). Returns how many.

        By default only what belongs to units already committed by another attempt:
        such an attempt can never commit, so this is safe while other drivers work on
        the same output (two coordinators, two `hsx extract`). `final=True` also removes
        every other shard no record names and every other unfinished write (a crashed
        ingestion's staging, a stale probe): only when no attempt can still commit,
        i.e. once every unit is committed, or by hand.
        """
        records = self.commits()
        committed: dict[int, set[str]] = {}
        for r in records:
            committed[r.unit] = {r.shard}
            if r.regenerations is not None:
                committed[r.unit].add(r.regenerations.key)

        def garbage(key: str) -> bool:
            unit = unit_of_key(key)
            if unit is None or unit not in committed:
                return final
            return key not in committed[unit]

        removed = self.storage.abort_incomplete_writes(None if final else garbage)
        for folder in (SHARDS_DIR, REGENERATIONS_DIR):
            for info in self.storage.list(folder):
                if garbage(info.key):
                    self.storage.delete(info.key)
                    removed += 1
        if removed:
            logger.info("removed %d orphaned objects from %s", removed, self)
        return removed
