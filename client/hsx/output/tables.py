"""The inputs and errors tables of an output: schemas, the writer and the readers.

Both are Arrow IPC files (docs/FORMAT.md): `inputs.arrow` holds every good sample
(sample_index, input_ids, loss_mask, length) in sample order, `errors.arrow` every row
refused at ingestion (sample_index, reason). Ingestion writes them through
`TableWriter`; workers, trainers, the scheduler and the dataset read them through
`hsx.output.Output`, which calls the readers here.

`TableWriter` writes record batches of exactly `rows_per_batch` rows (the last one
shorter) and records that number in the schema's metadata, so a reader finds row `r`
in batch `r // rows_per_batch` without reading the others: on an object store a worker
fetches only the batches of its unit (ranged reads of the Arrow file), not the table.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from hsx.output.storage import ObjectWriter, RangedFile, Storage

INPUTS_SCHEMA = pa.schema(
    [
        ("sample_index", pa.int64()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("length", pa.int32()),
    ]
)
ERRORS_SCHEMA = pa.schema([("sample_index", pa.int64()), ("reason", pa.string())])
MESSAGES_COLUMN = "messages"
# A regenerating job's answers, one table per committed unit (docs/FORMAT.md).
REGENERATIONS_SCHEMA = pa.schema(
    [
        ("sample_index", pa.int64()),
        ("messages", pa.string()),  # JSON: the conversation captured (regenerated)
        ("original", pa.string()),  # JSON: the dataset's conversation
        ("seeds", pa.list_(pa.int64())),  # sampling seed of each regenerated turn
        ("finish_reasons", pa.list_(pa.string())),  # vLLM's, per turn: stop | length
        ("generated_tokens", pa.int32()),
        ("truncated", pa.bool_()),  # a turn stopped at max_tokens
    ]
)
REGENERATE_KEY = b"hsx.regenerate"  # schema metadata: model and sampling parameters


IMAGES_COLUMN = "images"


def with_messages(schema: pa.Schema) -> pa.Schema:
    """The inputs schema of a regenerating job: each row's conversation kept (JSON)."""
    return schema.append(pa.field(MESSAGES_COLUMN, pa.string()))


def with_images(schema: pa.Schema) -> pa.Schema:
    """The inputs schema of a job that takes images: each row's images, the bytes of
    each as read (an empty list for a row without); `length` then counts their vision
    tokens (docs/FORMAT.md)."""
    return schema.append(pa.field(IMAGES_COLUMN, pa.list_(pa.large_binary())))


def inputs_schema(*, messages: bool = False, images: bool = False) -> pa.Schema:
    """The inputs table's schema for a job that keeps conversations and/or images."""
    schema = with_messages(INPUTS_SCHEMA) if messages else INPUTS_SCHEMA
    return with_images(schema) if images else schema

ROWS_PER_BATCH = 1024
_ROWS_KEY = b"hsx.rows_per_batch"
_KEEP_BATCHES = 4  # batches a TableRows keeps: a unit's rows lie in one or two


class _WriterFile:
    """An ObjectWriter as the file object pyarrow writes to (write, tell, flush, close)."""

    def __init__(self, writer: ObjectWriter) -> None:
        self._writer = writer
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._writer.write(view)
        return view.nbytes

    def tell(self) -> int:
        return self._writer.body_bytes

    def flush(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True


class TableWriter:
    """One Arrow IPC file written batch by batch; it appears only when `commit()` ends.

    On local disk it is staged in `.tmp/` and renamed into place; on an object store it
    is a multipart upload completed at commit. `abort()` leaves nothing behind.
    """

    def __init__(self, storage: Storage, key: str, schema: pa.Schema,
                 rows_per_batch: int = ROWS_PER_BATCH) -> None:
        if rows_per_batch < 1:
            raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
        self.url = storage.url(key)
        self.rows_per_batch = rows_per_batch
        self.schema = schema.with_metadata({_ROWS_KEY: str(rows_per_batch).encode()})
        self.rows = 0
        self._object = storage.open_writer(key)
        self._sink = pa.PythonFile(_WriterFile(self._object), mode="w")
        self._writer = pa.ipc.new_file(self._sink, self.schema)
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        """Append rows (any number: they are regrouped into batches of rows_per_batch)."""
        if not batch.num_rows:
            return
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        if self._pending_rows >= self.rows_per_batch:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        table = pa.Table.from_batches(self._pending, schema=self._pending[0].schema)
        full = table.num_rows if final else table.num_rows - table.num_rows % self.rows_per_batch
        # `take` makes fresh arrays: a slice's list columns keep their parent's child
        # buffer, and would be written with bytes that depend on where it was cut.
        rows = table.slice(0, full).take(pa.array(range(full), pa.int64()))
        for part in rows.combine_chunks().to_batches(max_chunksize=self.rows_per_batch):
            self._writer.write_batch(part)
        rest = table.slice(full)
        self._pending = rest.combine_chunks().to_batches() if rest.num_rows else []
        self._pending_rows = rest.num_rows
        self.rows += full

    def commit(self) -> None:
        if self._pending:
            self._flush(final=True)
        self._writer.close()
        self._sink.close()
        self._object.finish()

    def abort(self) -> None:
        try:
            self._writer.close()
            self._sink.close()
        finally:
            self._object.abort()


def read_table(storage: Storage, key: str) -> pa.Table:
    """A whole table: memory-mapped on local disk (no copy), one GET elsewhere."""
    path = storage.local_path(key)
    if path is not None:
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist; has the dataset been ingested?")
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()
    data = storage.read(key)
    return pa.ipc.open_file(pa.BufferReader(data)).read_all()


class TableRows:
    """Rows of a stored table by number, reading only the batches that hold them.

    On local disk the table is memory-mapped once; on an object store only the file's
    footer is read up front, and each batch when needed (the last few are kept).
    Tables written before rows_per_batch was recorded are read whole on first use.
    """

    def __init__(self, storage: Storage, key: str) -> None:
        self._table: pa.Table | None = None
        self._reader: Any = None
        self._batches: dict[int, pa.RecordBatch] = {}
        if storage.local_path(key) is not None:
            self._table = read_table(storage, key)
            return
        size = storage.size(key)
        self._reader = pa.ipc.open_file(pa.PythonFile(RangedFile(storage, key, size), mode="r"))
        per = (self._reader.schema.metadata or {}).get(_ROWS_KEY)
        self._per = int(per) if per else 0
        if not self._per:
            self._table = self._reader.read_all()

    def slice(self, start: int, stop: int) -> pa.Table:
        """Rows [start, stop) as a table."""
        if self._table is not None:
            return self._table.slice(start, stop - start)
        if stop <= start:
            return self._reader.schema.empty_table()
        first = start // self._per
        last = min((stop - 1) // self._per, self._reader.num_record_batches - 1)
        if first > last:
            return self._reader.schema.empty_table()
        batches = []
        for b in range(first, last + 1):
            batch = self._batches.pop(b, None)
            if batch is None:
                batch = self._reader.get_batch(b)
            self._batches[b] = batch  # most recent last
            batches.append(batch)
        while len(self._batches) > _KEEP_BATCHES:
            del self._batches[next(iter(self._batches))]
        table = pa.Table.from_batches(batches, schema=self._reader.schema)
        return table.slice(start - first * self._per, stop - start)
