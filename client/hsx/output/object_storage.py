"""`Storage` on object stores through obstore (Rust object_store): s3://, gs://, az://.

obstore is imported here only, and this module only when an object-store URI is used.
Each operation maps to one obstore call: `create` is `put(mode="create")`, i.e. a PUT
with `If-None-Match: *`, which the store refuses when the key exists; `read_range` is a
ranged GET; `list` lists a folder. Large objects stream:

- on S3 with static credentials, `S3PartsWriter` (s3_multipart.py): a multipart upload
  whose first part, holding the head, goes last; no local disk, bounded memory;
- otherwise without a head, obstore's own multipart writer (`open_writer`);
- otherwise (a head, but no part-numbered uploads: gs://, az://, or S3 credentials that
  only obstore can resolve, such as instance roles) the body is staged in a local
  temporary file and uploaded, head first, when it is finished.

Whatever the path, nothing is visible under the key until the upload completes.

obstore runs on a tokio runtime, which does not survive `fork()`: in a process forked
after obstore ran in its parent (a DataLoader worker, by default on Linux), its calls
would hang. There the reads a dataset makes (read, read_range, head, list) go through
hsx's own S3 client (httpx, which opens new connections after a fork) when the bucket
has static credentials; anything else says what to do instead of hanging.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import random
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from hsx.output.s3_multipart import (
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_PART_SIZE,
    S3MultipartClient,
    S3PartsWriter,
    S3Settings,
)
from hsx.output.storage import (
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectWriter,
    Storage,
    StorageError,
    check_key,
)

logger = logging.getLogger(__name__)

_S3_OWN_OPTIONS = frozenset({
    "endpoint", "region", "access_key_id", "secret_access_key", "session_token",
    "allow_http", "virtual_hosted_style_request",
})
_SPOOL_CHUNK = 8 * 2**20
# The preflight probe's retries: enough to ride out a flaky store (a 5xx, a dropped
# connection), few and quick enough that a wrong endpoint fails in seconds.
_QUICK_RETRY = {
    "max_retries": 4, "retry_timeout": _dt.timedelta(seconds=10),
    "backoff": {"init_backoff": _dt.timedelta(milliseconds=100),
                "max_backoff": _dt.timedelta(seconds=1), "base": 2},
}
_QUICK_ATTEMPTS = 5  # hsx's own client, for the bucket's HEAD
_QUICK_CALLS = 3  # obstore calls of the probe (each already retried by obstore)


_OBSTORE_PID: int | None = None
"""The process whose obstore calls started obstore's runtime (see the module docstring)."""


def _forked() -> bool:
    """True in a process forked after obstore ran in its parent."""
    return _OBSTORE_PID is not None and os.getpid() != _OBSTORE_PID


def _obstore(uri: str, what: str) -> Any:
    """The obstore module, or StorageError where it would hang (a forked process)."""
    global _OBSTORE_PID
    if _forked():
        raise StorageError(
            f"{uri}: cannot {what} in a process forked after obstore ran in its parent "
            "(its tokio runtime does not survive fork); give the bucket static credentials "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), or start workers with 'spawn' or "
            "'forkserver' (DataLoader(multiprocessing_context=...))"
        )
    import obstore

    _OBSTORE_PID = os.getpid()
    return obstore


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


_CALL_ATTEMPTS = 5
# What obstore does not retry itself (measured through tests/faultproxy.py): an answer
# cut off mid-body after the store acted ("request or response body error"), a
# connection reset while sending. The call is repeated whole; a create repeated after
# its first try landed fails with ObjectExistsError, which ShardWriter.commit resolves
# by reading the record back.
_TRANSIENT = ("body error", "error sending request", "connection reset",
              "connection closed", "IncompleteBody", "broken pipe")
_T = TypeVar("_T")


def _transient(err: Exception) -> bool:
    from obstore import exceptions as obx

    if isinstance(err, obx.AlreadyExistsError | obx.NotFoundError | FileNotFoundError
                  | obx.PermissionDeniedError | obx.UnauthenticatedError
                  | obx.PreconditionError):
        return False
    text = str(err)
    return any(marker in text for marker in _TRANSIENT)


def _call(what: str, fn: Callable[[], _T], attempts: int = _CALL_ATTEMPTS) -> _T:
    """`fn()` (one obstore call), repeated with backoff on transient failures that
    obstore's own retries leave (`_TRANSIENT`); errors become StorageErrors naming
    `what` and the cause."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as err:
            if attempt == attempts or not _transient(err):
                failed = _translate(err, what)
                if attempt > 1:
                    failed = type(failed)(f"{failed} (after {attempt} attempts)")
                raise failed from err
            delay = min(0.2 * 2 ** (attempt - 1), 2.0) * (0.5 + random.random())
            logger.warning("%s: %s; retrying in %.2f s", what, _first_line(err), delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def _translate(err: Exception, what: str) -> StorageError:
    """An obstore error as a StorageError whose message says what failed and why."""
    from obstore import exceptions as obx

    detail = _first_line(err)
    if isinstance(err, obx.AlreadyExistsError):
        return ObjectExistsError(f"{what} already exists")
    if isinstance(err, obx.NotFoundError | FileNotFoundError):  # obstore raises the latter
        return ObjectNotFoundError(f"{what} does not exist")
    if isinstance(err, obx.PermissionDeniedError | obx.UnauthenticatedError) or (
        "403 Forbidden" in str(err) or "401 Unauthorized" in str(err)
    ):
        return StorageError(f"{what}: access denied; check the credentials ({detail})")
    if "error sending request" in str(err):
        return StorageError(f"{what}: cannot reach the object store ({detail})")
    return StorageError(f"{what}: {detail}")


class ObjectStoreStorage(Storage):
    """A bucket (and prefix) as an output location; see the module docstring."""

    def __init__(
        self,
        uri: str,
        make_store: Any,
        *,
        multipart: S3MultipartClient | None = None,
        options: Mapping[str, Any] | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
    ) -> None:
        self.uri = uri.rstrip("/")
        self._make_store = make_store
        try:
            self.store = make_store(None)
        except Exception as err:  # obstore's configuration errors
            raise StorageError(f"{self.uri}: {_first_line(err)}") from err
        self.multipart = multipart
        self._options = dict(options or {})
        self.part_size = part_size
        self.max_inflight = max_inflight

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> ObjectStoreStorage:
        """`s3://bucket[/prefix]`, `gs://bucket[/prefix]` or `az://container[/prefix]`."""
        scheme, _, rest = uri.partition("://")
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not bucket:
            raise ValueError(f"storage URI {uri!r} names no bucket")
        if prefix:
            check_key(prefix)
        part_size = int(options.pop("part_size", DEFAULT_PART_SIZE))
        max_inflight = int(options.pop("max_inflight", DEFAULT_MAX_INFLIGHT))
        saved = dict(options)
        norm = f"{scheme.lower()}://{bucket}" + (f"/{prefix}" if prefix else "")
        if scheme.lower() == "s3":
            settings = S3Settings.resolve(bucket, options)
            # A pickled storage (a Ray actor's, a DataLoader worker's) uses the endpoint
            # and credentials resolved here, not whatever its process's environment says.
            saved.update(settings.as_options())
            multipart = S3MultipartClient(settings, prefix) if settings.static else None
            if multipart is None:
                logger.info(
                    "%s: no static credentials; obstore resolves them, and shards are staged "
                    "in a local temporary file before upload", norm,
                )
            extra = {k: v for k, v in options.items() if k not in _S3_OWN_OPTIONS}
            config: dict[str, Any] = {"region": settings.region, **extra}
            for name in ("endpoint", "access_key_id", "secret_access_key", "session_token"):
                value = getattr(settings, name)
                if value:
                    config[name] = value
            if settings.virtual_hosted_style:
                config["virtual_hosted_style_request"] = True

            def make_s3(retry: Any) -> Any:
                from obstore.store import S3Store

                return S3Store(
                    bucket, prefix=prefix or None, config=config,  # type: ignore[arg-type]
                    client_options={"allow_http": settings.allow_http},
                    retry_config=retry,
                )

            if settings.endpoint and settings.endpoint.startswith("http://") and not (
                settings.allow_http
            ):
                raise StorageError(
                    f"{norm}: endpoint {settings.endpoint} is plain HTTP; set "
                    "AWS_ALLOW_HTTP=true (or allow_http=True) to use it"
                )
            return cls(
                norm, make_s3, multipart=multipart, options=saved, part_size=part_size,
                max_inflight=max_inflight,
            )

        def make_other(retry: Any) -> Any:
            from obstore.store import from_url

            return from_url(uri, retry_config=retry, **options)

        return cls(
            norm, make_other, options=saved, part_size=part_size, max_inflight=max_inflight
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the URI and the resolved settings in another process (Ray actors,
        # DataLoader workers).
        options = {**self._options, "part_size": self.part_size, "max_inflight": self.max_inflight}
        return (_rebuild, (self.uri, options))

    # -- small objects

    def create(self, key: str, data: bytes) -> None:
        obstore = _obstore(self.uri, "write")
        key = check_key(key)
        _call(self.url(key), lambda: obstore.put(self.store, key, data, mode="create",
                                                 use_multipart=False))

    def put(self, key: str, data: bytes) -> None:
        obstore = _obstore(self.uri, "write")
        key = check_key(key)
        _call(self.url(key), lambda: obstore.put(self.store, key, data))

    # -- large objects

    def open_writer(self, key: str, *, head_size: int = 0) -> ObjectWriter:
        key = check_key(key)
        if self.multipart is not None:
            return S3PartsWriter(
                self, self.multipart, key, head_size,
                part_size=self.part_size, max_inflight=self.max_inflight,
            )
        if head_size == 0:
            return ObstoreStreamWriter(self, key)
        return StagedObjectWriter(self, key, head_size)

    # -- reading

    def _forked_client(self) -> S3MultipartClient | None:
        """hsx's own S3 client where obstore cannot run (see the module docstring)."""
        return self.multipart if _forked() else None

    def read(self, key: str) -> bytes:
        http = self._forked_client()
        if http is not None:
            data = http.get_object(check_key(key))
            if data is None:
                raise ObjectNotFoundError(f"{self.url(key)} does not exist")
            return data
        obstore = _obstore(self.uri, "read")
        key = check_key(key)
        return _call(self.url(key), lambda: bytes(obstore.get(self.store, key).bytes()))

    def read_range(self, key: str, start: int, length: int) -> memoryview:
        if start < 0 or length < 0:
            raise ValueError(f"bad range start={start} length={length}")
        if length == 0:
            return memoryview(b"")
        http = self._forked_client()
        if http is not None:
            got = http.get_object(check_key(key), start, length)
            if got is None:
                raise ObjectNotFoundError(f"{self.url(key)} does not exist")
            if len(got) != length:
                raise StorageError(f"{self.url(key)}: asked bytes [{start}, {start + length}), "
                                   f"got {len(got)}")
            return memoryview(got)
        obstore = _obstore(self.uri, "read")
        key = check_key(key)
        data = _call(f"{self.url(key)} [{start}, {start + length})", lambda: memoryview(
            obstore.get_range(self.store, key, start=start, length=length)))
        if data.nbytes != length:
            raise StorageError(
                f"{self.url(key)}: asked bytes [{start}, {start + length}), got {data.nbytes}"
            )
        return data

    def head(self, key: str) -> ObjectInfo | None:
        http = self._forked_client()
        if http is not None:
            size = http.head_object(check_key(key))
            return None if size is None else ObjectInfo(key, size)
        obstore = _obstore(self.uri, "read")
        key = check_key(key)
        try:
            meta = _call(self.url(key), lambda: obstore.head(self.store, key))
        except ObjectNotFoundError:
            return None
        return _info(key, meta)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        folder = check_key(prefix, folder=True)
        http = self._forked_client()
        if http is not None:
            return sorted((ObjectInfo(k, n) for k, n in http.list_objects(folder)),
                          key=lambda info: info.key)
        obstore = _obstore(self.uri, "list")

        def listing() -> list[ObjectInfo]:
            out: list[ObjectInfo] = []
            for batch in obstore.list(self.store, folder or None, chunk_size=1000):
                out.extend(_info(m["path"], m) for m in batch)
            return out

        return sorted(_call(f"listing {self.url(folder)}", listing), key=lambda i: i.key)

    def delete(self, key: str) -> None:
        obstore = _obstore(self.uri, "delete")
        key = check_key(key)
        try:
            _call(self.url(key), lambda: obstore.delete(self.store, key))
        except ObjectNotFoundError:
            return

    # -- checks and clean-up

    def check_writable(self) -> None:
        """Probe with few retries, so a wrong endpoint fails in seconds, not minutes.

        Also refuses a store that ignores conditional creates (`If-None-Match: *`): on
        it, two attempts of a unit could both "win".
        """
        obstore = _obstore(self.uri, "write")
        if self.multipart is not None:
            self._check_bucket()
        store = self._make_store(_QUICK_RETRY)
        probe = f".hsx-probe-{secrets.token_hex(6)}"
        where = f"{self.uri} (probe object {probe})"
        # The name is random: if it exists, a retry found our own first try.
        with contextlib.suppress(ObjectExistsError):
            _call(f"cannot write to {where}", lambda: obstore.put(
                store, probe, b"hsx", mode="create", use_multipart=False), _QUICK_CALLS)
        try:
            try:
                _call(where, lambda: obstore.put(
                    store, probe, b"again", mode="create", use_multipart=False),
                    _QUICK_CALLS)
            except ObjectExistsError:
                pass
            else:
                raise StorageError(
                    f"{self.uri}: the object store does not honour conditional writes "
                    "(a second PUT with If-None-Match: * replaced the object); hsx needs "
                    "them to commit each unit exactly once"
                )
            got = _call(where, lambda: bytes(obstore.get(store, probe).bytes()),
                        _QUICK_CALLS)
            if got != b"hsx":
                raise StorageError(f"{where}: read back {got!r} instead of what was written")
            if self.multipart is not None:
                self._check_multipart(probe + ".mp")
        finally:
            try:
                _call(where, lambda: obstore.delete(store, probe), _QUICK_CALLS)
            except StorageError as err:
                logger.warning("%s: could not delete the probe: %s", where, err)

    def _check_bucket(self) -> None:
        """HEAD the bucket first: SeaweedFS answers a PUT into a missing bucket with a
        500 (and creates the bucket as a side effect), which would hide the cause."""
        if self.multipart is None:
            return
        client = S3MultipartClient(
            self.multipart.settings, self.multipart.prefix, max_attempts=_QUICK_ATTEMPTS,
            timeout_s=10.0,
        )
        try:
            status = client.head_bucket()
        finally:
            client.close()
        bucket = client.settings.bucket
        origin = client.settings.endpoint or "AWS S3"
        if status == 404:
            raise StorageError(f"{self.uri}: bucket {bucket!r} does not exist at {origin}")
        if status in (401, 403):
            raise StorageError(
                f"{self.uri}: access to bucket {bucket!r} at {origin} denied; check the "
                "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
            )
        if status >= 300:
            raise StorageError(f"{self.uri}: bucket {bucket!r} at {origin} answered HTTP {status}")

    def _check_multipart(self, key: str) -> None:
        """A one-part upload: the calls `S3PartsWriter` makes, signed by this client."""
        client = self.multipart
        if client is None:
            return
        upload = client.create_upload(key)
        try:
            etag = client.upload_part(key, upload, 1, b"hsx")
            client.complete_upload(key, upload, [(1, etag)], 3)
        except BaseException:
            client.abort_upload(key, upload)
            raise
        self.delete(key)

    def abort_incomplete_writes(self, which: Callable[[str], bool] | None = None) -> int:
        if self.multipart is None:
            logger.info(
                "%s: unfinished uploads cannot be listed without static credentials; a "
                "bucket lifecycle rule should expire them", self.uri,
            )
            return 0
        uploads = [(key, upload_id) for key, upload_id in self.multipart.list_uploads()
                   if which is None or which(key)]
        for key, upload_id in uploads:
            self.multipart.abort_upload(key, upload_id)
        if uploads:
            logger.info("%s: aborted %d unfinished uploads", self.uri, len(uploads))
        return len(uploads)


def _info(key: str, meta: Mapping[str, Any]) -> ObjectInfo:
    """An ObjectInfo from obstore's ObjectMeta (path, size, e_tag, last_modified)."""
    modified = meta.get("last_modified")
    return ObjectInfo(key, int(meta["size"]), etag=meta.get("e_tag"),
                      modified=modified.timestamp() if modified is not None else None)


def _rebuild(uri: str, options: dict[str, Any]) -> Storage:
    return ObjectStoreStorage.from_uri(uri, **options)


class ObstoreStreamWriter(ObjectWriter):
    """obstore's multipart writer, for objects without a head. Its `close()` completes
    the upload; an abort drops the writer unclosed, which aborts the upload."""

    def __init__(self, storage: ObjectStoreStorage, key: str) -> None:
        obstore = _obstore(storage.uri, "write")
        super().__init__(storage, key, 0)
        self._store = storage
        self._file: Any = obstore.open_writer(
            storage.store, key, buffer_size=storage.part_size,
            max_concurrency=storage.max_inflight,
        )

    def _write(self, data: memoryview) -> None:
        try:
            self._file.write(data)
        except Exception as err:
            raise _translate(err, self._store.url(self.key)) from err

    def _finish(self, head: bytes) -> int:
        try:
            self._file.close()
        except Exception as err:
            raise _translate(err, self._store.url(self.key)) from err
        return self.body_bytes

    def _abort(self) -> None:
        # The writer's context manager aborts the upload when left by an exception.
        try:
            self._file.__exit__(StorageError, StorageError("aborted"), None)
        except Exception as err:
            logger.warning("%s: abort: %s", self._store.url(self.key), _first_line(err))


class StagedObjectWriter(ObjectWriter):
    """The body in a local temporary file (`TMPDIR`), uploaded head first at `finish()`."""

    def __init__(self, storage: ObjectStoreStorage, key: str, head_size: int) -> None:
        super().__init__(storage, key, head_size)
        self._store = storage
        self._file = tempfile.TemporaryFile(prefix="hsx-upload-")  # noqa: SIM115

    def _write(self, data: memoryview) -> None:
        self._file.write(data)

    def _chunks(self, head: bytes) -> Iterator[bytes]:
        yield head
        self._file.seek(0)
        while chunk := self._file.read(_SPOOL_CHUNK):
            yield chunk

    def _finish(self, head: bytes) -> int:
        obstore = _obstore(self._store.uri, "write")
        self._file.flush()
        try:
            _call(self._store.url(self.key), lambda: obstore.put(
                self._store.store, self.key, self._chunks(head),
                chunk_size=self._store.part_size, max_concurrency=self._store.max_inflight,
            ))
        finally:
            self._file.close()
        return len(head) + self.body_bytes

    def _abort(self) -> None:
        self._file.close()

