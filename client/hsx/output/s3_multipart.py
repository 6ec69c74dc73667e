"""S3 multipart uploads with explicit part numbers: what lets a shard stream to a bucket.

A shard's header (its first bytes) is known only when its last sample is in, and an
object store cannot seek back. S3 multipart uploads take parts in any order and
assemble them by part number at completion, so `S3PartsWriter` keeps part 1 (the head
plus the first `part_size - head_size` bytes of the body) in memory, uploads parts 2..n
while the body streams, and uploads part 1 beside the last ones, when the head is known.
Memory stays at about `part_size * (max_inflight + 2)`; nothing is staged on local disk; until
CompleteMultipartUpload nothing is visible, and an abort (or a crash, then
`abort_incomplete_writes`) removes the parts. docs/ARCHITECTURE.md ("Storage") has the
options that were weighed.

obstore (Rust object_store) does everything else hsx needs from S3, but its Python API
numbers parts in upload order only; hence this small client for the four multipart calls
(plus listing uploads and two HEADs), signed with AWS Signature V4 over httpx, with
retries and backoff on 5xx, throttling and dropped connections. It needs static
credentials (options or `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` /
`AWS_SESSION_TOKEN`); without them the object store falls back to staging (see
`object_storage.py`).
"""

from __future__ import annotations

import concurrent.futures
import datetime as _dt
import hashlib
import hmac
import logging
import os
import random
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote
from xml.sax.saxutils import escape

from hsx.output.storage import ObjectNotFoundError, ObjectWriter, StorageError

if TYPE_CHECKING:
    import httpx

    from hsx.output.storage import Storage

logger = logging.getLogger(__name__)

MIN_PART_SIZE = 5 * 2**20
"""S3's smallest part but the last."""
MAX_PARTS = 10_000
DEFAULT_PART_SIZE = 16 * 2**20
DEFAULT_MAX_INFLIGHT = 4

_UNSIGNED = "UNSIGNED-PAYLOAD"
_SEND_CHUNK = 1 << 20  # pieces handed to the HTTP stack (it copies each into its buffer)
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_TRUTHY = frozenset({"1", "true", "yes", "on"})


def env_flag(value: object) -> bool:
    """A boolean option given as a bool or as an environment-style string."""
    return value if isinstance(value, bool) else str(value).strip().lower() in _TRUTHY


@dataclass(frozen=True)
class S3Settings:
    """Where a bucket is and how to sign for it (secrets kept out of `repr`)."""

    bucket: str
    region: str
    endpoint: str | None
    access_key_id: str | None
    secret_access_key: str | None
    session_token: str | None
    allow_http: bool
    virtual_hosted_style: bool

    def __repr__(self) -> str:
        return (
            f"S3Settings(bucket={self.bucket!r}, region={self.region!r}, "
            f"endpoint={self.endpoint!r}, credentials={'static' if self.static else 'none'})"
        )

    @property
    def static(self) -> bool:
        """True when a key pair is known here (else obstore resolves credentials itself)."""
        return bool(self.access_key_id and self.secret_access_key)

    @classmethod
    def resolve(cls, bucket: str, options: Mapping[str, Any]) -> S3Settings:
        """Explicit options first, then the usual AWS environment variables."""

        def pick(name: str, *env: str) -> str | None:
            value = options.get(name)
            if value is None:
                value = next((os.environ[e] for e in env if os.environ.get(e)), None)
            return None if value is None else str(value)

        endpoint = pick("endpoint", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
        return cls(
            bucket=bucket,
            region=pick("region", "AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1",
            endpoint=endpoint.rstrip("/") if endpoint else None,
            access_key_id=pick("access_key_id", "AWS_ACCESS_KEY_ID"),
            secret_access_key=pick("secret_access_key", "AWS_SECRET_ACCESS_KEY"),
            session_token=pick("session_token", "AWS_SESSION_TOKEN", "AWS_TOKEN"),
            allow_http=env_flag(pick("allow_http", "AWS_ALLOW_HTTP") or "false"),
            virtual_hosted_style=env_flag(
                pick("virtual_hosted_style_request", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST")
                or "false"
            ),
        )

    def as_options(self) -> dict[str, Any]:
        """These settings as `Storage.for_uri` options (what a pickled storage carries)."""
        options: dict[str, Any] = {
            "region": self.region, "allow_http": self.allow_http,
            "virtual_hosted_style_request": self.virtual_hosted_style,
        }
        for name in ("endpoint", "access_key_id", "secret_access_key", "session_token"):
            value = getattr(self, name)
            if value:
                options[name] = value
        return options

    def base_url(self) -> tuple[str, str]:
        """(scheme://host, path prefix) of the bucket: path style behind an endpoint."""
        if self.endpoint is None:
            return f"https://{self.bucket}.s3.{self.region}.amazonaws.com", ""
        scheme, _, host = self.endpoint.partition("://")
        if self.virtual_hosted_style:
            return f"{scheme}://{self.bucket}.{host}", ""
        return self.endpoint, f"/{quote(self.bucket, safe='')}"


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def sign_v4(
    settings: S3Settings,
    method: str,
    host: str,
    path: str,
    query: str,
    payload_sha256: str,
    now: _dt.datetime | None = None,
) -> dict[str, str]:
    """Headers that sign a request with AWS Signature V4 (`path` and `query` canonical)."""
    if not settings.static:
        raise StorageError(f"s3://{settings.bucket}: no static credentials to sign with")
    now = now or _dt.datetime.now(_dt.timezone.utc)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    headers = {"host": host, "x-amz-content-sha256": payload_sha256, "x-amz-date": amz_date}
    if settings.session_token:
        headers["x-amz-security-token"] = settings.session_token
    names = sorted(headers)
    canonical = "\n".join([
        method,
        path or "/",
        query,
        "".join(f"{n}:{headers[n]}\n" for n in names),
        ";".join(names),
        payload_sha256,
    ])
    scope = f"{day}/{settings.region}/s3/aws4_request"
    to_sign = "\n".join([
        "AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()
    ])
    key = f"AWS4{settings.secret_access_key}".encode()
    for part in (day, settings.region, "s3", "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={settings.access_key_id}/{scope}, "
        f"SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    del headers["host"]
    return headers


def _canonical_query(params: Mapping[str, str]) -> str:
    return "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(params.items())
    )


def _xml_text(body: bytes, tag: str) -> list[str]:
    """Texts of every element named `tag` (namespace ignored)."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return []
    return [el.text or "" for el in root.iter() if el.tag.rsplit("}", 1)[-1] == tag]


@dataclass(frozen=True)
class S3Response:
    status: int
    headers: Mapping[str, str]
    body: bytes


class S3MultipartClient:
    """The multipart calls of S3's REST API, signed with SigV4, retried with backoff.

    Safe to share between threads; after a fork the child opens its own connections.
    """

    def __init__(
        self,
        settings: S3Settings,
        prefix: str = "",
        *,
        max_attempts: int = 6,
        timeout_s: float = 120.0,
    ) -> None:
        if settings.endpoint and settings.endpoint.startswith("http://") and not (
            settings.allow_http
        ):
            raise StorageError(
                f"s3://{settings.bucket}: endpoint {settings.endpoint} is plain HTTP; set "
                "AWS_ALLOW_HTTP=true (or allow_http=True) to use it"
            )
        self.settings = settings
        self.prefix = prefix.strip("/")
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self._origin, self._bucket_path = settings.base_url()
        self._host = self._origin.partition("://")[2]
        self._http: httpx.Client | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def _client(self) -> httpx.Client:
        with self._lock:
            if self._http is None or self._pid != os.getpid():
                import httpx

                self._http = httpx.Client(timeout=self.timeout_s, follow_redirects=False)
                self._pid = os.getpid()
            return self._http

    def close(self) -> None:
        with self._lock:
            if self._http is not None and self._pid == os.getpid():
                self._http.close()
            self._http = None

    def full_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def url(self, key: str) -> str:
        return f"s3://{self.settings.bucket}/{self.full_key(key)}"

    def request(
        self,
        method: str,
        key: str | None,
        params: Mapping[str, str] | None = None,
        body: bytes | Sequence[memoryview] = b"",
        *,
        sign_payload: bool = True,
        headers: Mapping[str, str] | None = None,
        ok: Callable[[int], bool] = lambda s: 200 <= s < 300,
    ) -> S3Response:
        """Send one request (to the bucket when `key` is None); retried on transient errors.

        `body` is bytes or a sequence of buffers sent one after the other without being
        joined first (a part is 16 MiB: one copy fewer). `headers` are sent unsigned
        (e.g. Range). Returns the response when `ok(status)`; raises StorageError
        otherwise.
        """
        import httpx

        path = self._bucket_path
        if key is not None:
            path += "/" + quote(self.full_key(key), safe="/-_.~")
        elif not path:
            path = "/"
        query = _canonical_query(params or {})
        url = self._origin + path + (f"?{query}" if query else "")
        pieces = [body] if isinstance(body, bytes) else list(body)
        length = sum(memoryview(p).nbytes for p in pieces)
        if sign_payload:
            sha = hashlib.sha256()
            for piece in pieces:
                sha.update(piece)
            payload_hash = sha.hexdigest()
        else:
            payload_hash = _UNSIGNED
        what = f"{method} {self.url(key) if key is not None else f's3://{self.settings.bucket}'}"
        for attempt in range(1, self.max_attempts + 1):
            signed = sign_v4(self.settings, method, self._host, path, query, payload_hash)
            signed.update(headers or {})
            stream = None
            if length:
                signed["content-length"] = str(length)
                stream = _send_pieces(pieces)
            try:
                resp = self._client().request(method, url, content=stream, headers=signed)
            except httpx.TransportError as err:
                if attempt == self.max_attempts:
                    raise StorageError(
                        f"{what}: cannot reach {self._origin}: {err!r} "
                        f"(after {attempt} attempts)"
                    ) from err
                self._backoff(attempt, f"{what}: {err!r}")
                continue
            content = resp.content
            # CompleteMultipartUpload may answer 200 with an error in the body.
            error_in_body = resp.status_code == 200 and content.lstrip().startswith(
                b"<?xml"
            ) and b"<Error>" in content[:512]
            if ok(resp.status_code) and not error_in_body:
                return S3Response(resp.status_code, resp.headers, content)
            code = (_xml_text(content, "Code") or [""])[0]
            retryable = (
                resp.status_code in _RETRY_STATUS
                or code in ("SlowDown", "InternalError", "RequestTimeout")
            ) and code not in ("NoSuchBucket",)
            if retryable and attempt < self.max_attempts:
                self._backoff(attempt, f"{what}: HTTP {resp.status_code} {code}")
                continue
            raise self._error(what, resp.status_code, code, content)
        raise AssertionError("unreachable")  # pragma: no cover

    def _backoff(self, attempt: int, why: str) -> None:
        delay = min(0.1 * 2 ** (attempt - 1), 5.0) * (0.5 + random.random())
        logger.warning("%s; retrying in %.2f s", why, delay)
        time.sleep(delay)

    def _error(self, what: str, status: int, code: str, body: bytes) -> StorageError:
        message = (_xml_text(body, "Message") or [""])[0]
        detail = f"HTTP {status}" + (f" {code}" if code else "")
        detail += f": {message}" if message else ""
        if status in (401, 403) or code in ("InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StorageError(f"{what}: access denied ({detail}); check the credentials")
        if code == "NoSuchBucket":
            return StorageError(f"{what}: bucket {self.settings.bucket!r} does not exist")
        if status == 404:
            return ObjectNotFoundError(f"{what}: not found ({detail})")
        return StorageError(f"{what}: {detail}")

    # -- the calls

    def head_bucket(self) -> int:
        """The status of HEAD on the bucket (200 exists and is ours, 404 missing, 403 ...)."""
        return self.request("HEAD", None, ok=lambda s: True).status

    def head_object(self, key: str) -> int | None:
        """The object's size, or None if it does not exist."""
        resp = self.request("HEAD", key, ok=lambda s: s in (200, 404))
        return int(resp.headers["content-length"]) if resp.status == 200 else None

    def get_object(self, key: str, start: int = 0, length: int | None = None) -> bytes | None:
        """The object (or `length` bytes from `start`), or None if it does not exist."""
        headers = {} if length is None else {"range": f"bytes={start}-{start + length - 1}"}
        resp = self.request("GET", key, headers=headers, ok=lambda s: s in (200, 206, 404))
        return None if resp.status == 404 else resp.body

    def list_objects(self, folder: str) -> list[tuple[str, int]]:
        """(key relative to the prefix, size) of every object under `folder` (ListObjectsV2)."""
        base = f"{self.prefix}/" if self.prefix else ""
        params = {"list-type": "2", "prefix": base + (f"{folder}/" if folder else "")}
        out: list[tuple[str, int]] = []
        while True:
            root = ET.fromstring(self.request("GET", None, params).body)
            for item in root.iter():
                if item.tag.rsplit("}", 1)[-1] != "Contents":
                    continue
                fields = {c.tag.rsplit("}", 1)[-1]: c.text or "" for c in item}
                out.append((fields.get("Key", "")[len(base):], int(fields.get("Size", "0"))))
            token = [e.text for e in root.iter() if e.tag.rsplit("}", 1)[-1] ==
                     "NextContinuationToken"]
            if not token or not token[0]:
                return out
            params = {**params, "continuation-token": token[0]}

    def put_object(self, key: str, body: Sequence[memoryview]) -> None:
        self.request("PUT", key, body=body, sign_payload=False)

    def create_upload(self, key: str) -> str:
        resp = self.request("POST", key, {"uploads": ""})
        ids = _xml_text(resp.body, "UploadId")
        if not ids or not ids[0]:
            raise StorageError(f"CreateMultipartUpload {self.url(key)}: no UploadId in the answer")
        return ids[0]

    def upload_part(
        self, key: str, upload_id: str, number: int, body: bytes | Sequence[memoryview]
    ) -> str:
        """Upload part `number` (1-based; re-uploading a number replaces it); its ETag."""
        resp = self.request(
            "PUT", key, {"partNumber": str(number), "uploadId": upload_id}, body,
            sign_payload=False,
        )
        etag = resp.headers.get("etag")
        if not etag:
            raise StorageError(f"UploadPart {self.url(key)} #{number}: no ETag in the answer")
        return etag

    def complete_upload(
        self, key: str, upload_id: str, parts: list[tuple[int, str]], size: int
    ) -> None:
        """Assemble the parts (sorted by number) into the object; idempotent across retries."""
        body = "".join(
            f"<Part><PartNumber>{n}</PartNumber><ETag>{escape(etag)}</ETag></Part>"
            for n, etag in sorted(parts)
        )
        xml = f"<CompleteMultipartUpload>{body}</CompleteMultipartUpload>".encode()
        try:
            self.request("POST", key, {"uploadId": upload_id}, xml)
        except ObjectNotFoundError:
            # A retry after a completion whose answer was lost finds no upload any more.
            if self.head_object(key) != size:
                raise
            logger.info("%s: upload was already completed", self.url(key))

    def abort_upload(self, key: str, upload_id: str) -> None:
        self.request("DELETE", key, {"uploadId": upload_id}, ok=lambda s: s in (200, 204, 404))

    def list_uploads(self) -> list[tuple[str, str]]:
        """(key relative to the prefix, upload id) of every unfinished upload under it."""
        prefix = f"{self.prefix}/" if self.prefix else ""
        out: list[tuple[str, str]] = []
        params = {"uploads": "", "prefix": prefix}
        while True:
            resp = self.request("GET", None, params)
            root = ET.fromstring(resp.body)
            for upload in root.iter():
                if upload.tag.rsplit("}", 1)[-1] != "Upload":
                    continue
                fields = {c.tag.rsplit("}", 1)[-1]: c.text or "" for c in upload}
                out.append((fields.get("Key", "")[len(prefix):], fields.get("UploadId", "")))
            if (_xml_text(resp.body, "IsTruncated") or ["false"])[0] != "true":
                return out
            params = {
                **params,
                "key-marker": (_xml_text(resp.body, "NextKeyMarker") or [""])[0],
                "upload-id-marker": (_xml_text(resp.body, "NextUploadIdMarker") or [""])[0],
            }


def _send_pieces(pieces: list[Any]) -> Iterator[bytes]:
    # memoryviews, typed as bytes for httpx: its HTTP/1.1 writer takes any buffer.
    for piece in pieces:
        view = memoryview(piece).cast("B")
        for i in range(0, view.nbytes, _SEND_CHUNK):
            yield view[i : i + _SEND_CHUNK]  # type: ignore[misc]


class S3PartsWriter(ObjectWriter):
    """Streams one object as a multipart upload whose part 1 (head + first body bytes)
    is uploaded last; see the module docstring. A body that fits in part 1 is one PUT.

    A part is a list of buffers sent one after the other. Bytes written with
    `keep=True` (a shard's samples, which the shard writer owns and never changes) are
    referenced, not copied; other writes are copied once. A part's buffers are released
    when its upload is done. Part 1 goes up beside the last parts, as soon as the head
    is known.
    """

    def __init__(
        self,
        storage: Storage,
        client: S3MultipartClient,
        key: str,
        head_size: int,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
    ) -> None:
        super().__init__(storage, key, head_size)
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be >= {MIN_PART_SIZE}, got {part_size}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self._client = client
        self._part_size = part_size
        self._first: list[memoryview] | None = None  # the body of part 1, behind the head
        self._pieces: list[memoryview] = []  # the part being gathered
        self._copied = bytearray()  # copied bytes not yet closed into a piece
        self._room = max(MIN_PART_SIZE, part_size - head_size)  # of the part being gathered
        self._fill = 0
        self._upload_id: str | None = None
        self._next_part = 2
        self._etags: dict[int, str] = {}
        self._error: BaseException | None = None
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_inflight, thread_name_prefix="hsx-s3-part"
        )
        self._futures: list[concurrent.futures.Future[None]] = []

    def _write(self, data: memoryview) -> None:
        self._append(data, keep=False)

    def _write_kept(self, data: memoryview) -> None:
        self._append(data, keep=True)

    def _append(self, data: memoryview, *, keep: bool) -> None:
        self._raise_pending()
        while data.nbytes:
            take = min(self._room - self._fill, data.nbytes)
            if keep:
                self._close_copied()
                self._pieces.append(data[:take])
            else:
                self._copied += data[:take]
            self._fill += take
            data = data[take:]
            if self._fill == self._room:
                self._close_copied()
                full, self._pieces = self._pieces, []
                self._room, self._fill = self._part_size, 0
                if self._first is None:
                    self._first = full
                else:
                    self._submit(self._next_number(), full)

    def _close_copied(self) -> None:
        if self._copied:
            self._pieces.append(memoryview(self._copied))
            self._copied = bytearray()

    def _next_number(self) -> int:
        number = self._next_part
        if number > MAX_PARTS:
            raise StorageError(
                f"{self._client.url(self.key)}: more than {MAX_PARTS} parts of "
                f"{self._part_size} bytes; use a larger part_size"
            )
        self._next_part += 1
        return number

    def _submit(self, number: int, pieces: list[memoryview]) -> None:
        if self._upload_id is None:
            self._upload_id = self._client.create_upload(self.key)
        self._slots.acquire()  # bounded memory: wait while max_inflight parts are uploading
        self._raise_pending()
        upload_id = self._upload_id

        def run() -> None:
            try:
                if self._error is None:
                    self._etags[number] = self._client.upload_part(
                        self.key, upload_id, number, pieces
                    )
            except BaseException as err:  # re-raised in the writer's thread
                self._error = err
            finally:
                pieces.clear()  # the buffers go as soon as their part is up
                self._slots.release()

        self._futures.append(self._pool.submit(run))

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def _finish(self, head: bytes) -> int:
        size = len(head) + self.body_bytes
        self._close_copied()
        if self._first is None:  # all of it fits in one part: a plain PUT
            self._pool.shutdown()
            self._client.put_object(self.key, [memoryview(head), *self._pieces])
            return size
        if self._pieces:
            self._submit(self._next_number(), self._pieces)
            self._pieces = []
        self._submit(1, [memoryview(head), *self._first])
        self._first = None
        concurrent.futures.wait(self._futures)
        self._pool.shutdown()
        self._raise_pending()
        if self._upload_id is None:
            raise AssertionError("internal: parts without an upload")  # pragma: no cover
        parts = sorted(self._etags.items())
        if [n for n, _ in parts] != list(range(1, len(parts) + 1)):
            raise StorageError(
                f"{self._client.url(self.key)}: parts missing, have {sorted(self._etags)}"
            )
        self._client.complete_upload(self.key, self._upload_id, parts, size)
        return size

    def _abort(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._first, self._pieces, self._copied = None, [], bytearray()
        if self._upload_id is not None:
            try:
                self._client.abort_upload(self.key, self._upload_id)
            except StorageError as err:
                logger.warning(
                    "%s: could not abort upload %s (abort_incomplete_writes will): %s",
                    self._client.url(self.key), self._upload_id, err,
                )
