"""hsx.output storage: URI dispatch, keys, and the local-disk implementation."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from hsx.output import (
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    Storage,
    StorageError,
)
from hsx.output.local_storage import LocalStorage
from hsx.output.storage import STAGING_DIR, check_key

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path) -> LocalStorage:
    st = Storage.for_uri(tmp_path / "out")
    assert isinstance(st, LocalStorage)
    return st


# --------------------------------------------------------------------------- dispatch


def test_for_uri_takes_paths_and_file_uris(tmp_path: Path) -> None:
    by_path = Storage.for_uri(str(tmp_path))
    by_uri = Storage.for_uri(tmp_path.as_uri())
    assert isinstance(by_path, LocalStorage) and isinstance(by_uri, LocalStorage)
    assert by_path.root == by_uri.root == tmp_path
    assert by_path.uri == tmp_path.as_uri()
    assert by_path.is_local


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("ftp://host/x", "unsupported storage URI"),
        ("file://otherhost/x", "only local files"),
        ("s3://", "names no bucket"),
        ("s3://bucket/../x", "bad storage key"),
    ],
)
def test_for_uri_refuses_what_it_cannot_serve(uri: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Storage.for_uri(uri)


def test_local_storage_takes_no_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no storage options"):
        Storage.for_uri(tmp_path, endpoint="http://x")


def test_importing_storage_stays_light(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import sys
        from hsx.output import Storage
        Storage.for_uri(sys.argv[1]).check_writable()
        print(sorted(m for m in ("obstore", "httpx", "torch", "vllm", "ray") if m in sys.modules))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
        check=True, cwd=REPO,
    )
    assert out.stdout.strip() == "[]"


def test_object_store_uri_imports_obstore_only_then() -> None:
    code = textwrap.dedent("""
        import sys
        from hsx.output import Storage
        assert "obstore" not in sys.modules
        st = Storage.for_uri("s3://some-bucket/prefix", endpoint="http://127.0.0.1:9",
                             access_key_id="k", secret_access_key="s", allow_http=True)
        print(type(st).__name__, st.uri, "obstore" in sys.modules)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.split() == ["ObjectStoreStorage", "s3://some-bucket/prefix", "True"]


def test_gcs_and_azure_uris() -> None:
    gcs = Storage.for_uri("gs://bucket/prefix/x")
    assert gcs.uri == "gs://bucket/prefix/x" and not gcs.is_local
    with pytest.raises(StorageError, match=r"az://container: .*Account must be specified"):
        Storage.for_uri("az://container")
    azure = Storage.for_uri("az://container/p", account_name="acct")
    assert azure.uri == "az://container/p"


def test_plain_http_endpoint_needs_allow_http() -> None:
    with pytest.raises(StorageError, match="AWS_ALLOW_HTTP"):
        Storage.for_uri(
            "s3://b", endpoint="http://127.0.0.1:9", access_key_id="k", secret_access_key="s"
        )


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "./a", "a b", "a\\b", ".tmp/x"])
def test_bad_keys_are_refused(store: LocalStorage, key: str) -> None:
    with pytest.raises(ValueError, match="storage key"):
        store.put(key, b"x")


def test_folder_keys() -> None:
    assert check_key("", folder=True) == ""
    assert check_key("commits/", folder=True) == "commits"
    with pytest.raises(ValueError):
        check_key("commits/")


# --------------------------------------------------------------------------- local storage


def test_create_is_create_if_absent(store: LocalStorage) -> None:
    store.create("commits/unit-000001.json", b"first")
    with pytest.raises(ObjectExistsError, match="already exists"):
        store.create("commits/unit-000001.json", b"second")
    assert store.read("commits/unit-000001.json") == b"first"
    assert not list((store.root / STAGING_DIR).iterdir())


def test_create_race_has_exactly_one_winner(store: LocalStorage) -> None:
    n = 16
    barrier = threading.Barrier(n)
    won: list[int] = []
    lost: list[int] = []

    def attempt(i: int) -> None:
        barrier.wait()
        try:
            store.create("commits/unit-000007.json", str(i).encode())
            won.append(i)
        except ObjectExistsError:
            lost.append(i)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == n - 1
    assert store.read("commits/unit-000007.json") == str(won[0]).encode()


def test_put_replaces_atomically(store: LocalStorage) -> None:
    store.put("complete.json", b"1")
    store.put("complete.json", b"22")
    assert store.read("complete.json") == b"22"
    assert store.head("complete.json") == ObjectInfo("complete.json", 2)


def test_read_range_head_exists_size(store: LocalStorage) -> None:
    store.put("a/blob", bytes(range(256)))
    assert bytes(store.read_range("a/blob", 10, 5)) == bytes(range(10, 15))
    assert bytes(store.read_range("a/blob", 0, 0)) == b""
    assert store.exists("a/blob") and store.size("a/blob") == 256
    assert store.head("a/missing") is None and not store.exists("a/missing")
    assert store.head("a") is None  # a folder is not an object
    with pytest.raises(StorageError, match="has 256 bytes"):
        store.read_range("a/blob", 250, 10)
    with pytest.raises(ObjectNotFoundError):
        store.read_range("a/missing", 0, 1)
    with pytest.raises(ObjectNotFoundError):
        store.read("a/missing")
    with pytest.raises(ObjectNotFoundError):
        store.size("a/missing")
    with pytest.raises(FileNotFoundError):  # the error is also a FileNotFoundError
        store.read("a")


def test_list_is_by_folder_and_hides_staging(store: LocalStorage) -> None:
    for key in ["commits/unit-000002.json", "commits/unit-000001.json", "commits/x/y",
                "commitsX/z", "manifest.json"]:
        store.put(key, b"k")
    (store.root / STAGING_DIR / "leftover.part").write_bytes(b"partial")
    keys = [i.key for i in store.list("commits")]
    assert keys == ["commits/unit-000001.json", "commits/unit-000002.json", "commits/x/y"]
    assert [i.key for i in store.list("commits/")] == keys
    assert [i.key for i in store.list()] == [*keys, "commitsX/z", "manifest.json"]
    assert store.list("nothing-here") == []
    assert all(i.size == 1 for i in store.list())


def test_delete(store: LocalStorage) -> None:
    store.put("shards/s", b"x")
    store.delete("shards/s")
    store.delete("shards/s")  # missing: fine
    assert store.list("shards") == []


def test_local_path(store: LocalStorage) -> None:
    store.put("shards/s", b"abc")
    path = store.local_path("shards/s")
    assert path == store.root / "shards" / "s" and path.read_bytes() == b"abc"
    with pytest.raises(ValueError):
        store.local_path("../escape")


def test_streamed_object_appears_only_when_finished(store: LocalStorage) -> None:
    body = os.urandom(3 * 2**20 + 17)
    with store.open_writer("shards/unit-000001-a.safetensors", head_size=8) as w:
        for i in range(0, len(body), 1 << 20):
            w.write(memoryview(body)[i : i + (1 << 20)])
            assert store.list("shards") == []
        info = w.finish(b"HEADER!!")
    assert info == ObjectInfo("shards/unit-000001-a.safetensors", len(body) + 8)
    assert store.read(info.key) == b"HEADER!!" + body
    assert list((store.root / STAGING_DIR).iterdir()) == []


def test_streamed_object_with_a_longer_head_is_rewritten(store: LocalStorage) -> None:
    with store.open_writer("shards/s", head_size=4) as w:
        w.write(b"body")
        w.finish(b"a much longer head|")
    assert store.read("shards/s") == b"a much longer head|body"
    with store.open_writer("shards/t", head_size=4) as w:
        w.write(b"body")
        w.finish(b"hd")
    assert store.read("shards/t") == b"hdbody"


def test_writer_without_head(store: LocalStorage) -> None:
    with store.open_writer("inputs.arrow") as w:
        w.write(b"abc")
        with pytest.raises(ValueError, match="without a head"):
            w.finish(b"h")
    assert not store.exists("inputs.arrow")  # the refused finish aborted it
    with store.open_writer("inputs.arrow") as w:
        w.write(b"abc")
        w.finish()
    assert store.read("inputs.arrow") == b"abc"


def test_aborted_writer_leaves_nothing(store: LocalStorage) -> None:
    with pytest.raises(RuntimeError, match="boom"), \
            store.open_writer("shards/s", head_size=16) as w:
        w.write(b"x" * 1000)
        raise RuntimeError("boom")
    assert store.list() == []
    assert list((store.root / STAGING_DIR).iterdir()) == []
    with pytest.raises(RuntimeError, match="already aborted"):
        w.write(b"more")


def test_writer_syncs_in_the_background(
    store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hsx.output.local_storage as local

    synced: list[int] = []
    monkeypatch.setattr(local, "SYNC_EVERY", 1000)
    real = os.fdatasync
    monkeypatch.setattr(local.os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    with store.open_writer("big") as w:
        for _ in range(10):
            w.write(b"y" * 600)
        w.finish()
    assert synced, "no background fdatasync during a long write"
    assert store.size("big") == 6000


def _aligned(data: bytes) -> memoryview:
    import numpy as np

    block = np.empty(len(data) + 4096, np.uint8)
    skip = -int(block.ctypes.data) % 4096
    view = block[skip : skip + len(data)]
    view[:] = np.frombuffer(data, np.uint8)
    return memoryview(view)


def _writes_by_descriptor(monkeypatch: pytest.MonkeyPatch, fail_direct: bool = False
                          ) -> list[tuple[str, int]]:
    """Records ("direct" or "cached", bytes) per write of storages made from now on, with
    direct I/O on; `fail_direct`: direct writes are refused with EINVAL, as by a file
    system that wants a larger alignment."""
    import errno

    import hsx.output.local_storage as local

    monkeypatch.setenv("HSX_DIRECT_IO", "1")

    seen: list[tuple[str, int]] = []
    real_open, real_write_all = local.os.open, local._write_all
    direct_fds: set[int] = set()

    def opened(path: Any, flags: int, *args: Any) -> int:
        fd = real_open(path, flags, *args)
        if flags & getattr(os, "O_DIRECT", 0):
            direct_fds.add(fd)
        return fd

    def write_all(fd: int, data: memoryview, offset: int | None = None) -> None:
        direct = fd in direct_fds
        if direct and fail_direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        seen.append(("direct" if direct else "cached", data.nbytes))
        real_write_all(fd, data, offset)

    monkeypatch.setattr(local.os, "open", opened)
    monkeypatch.setattr(local, "_write_all", write_all)
    return seen


def _skip_without_direct_io(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / "direct-probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except (AttributeError, OSError):
        pytest.skip("no O_DIRECT on this file system")
    finally:
        (folder / "direct-probe").unlink(missing_ok=True)


def test_aligned_bodies_bypass_the_page_cache_and_the_rest_does_not(
    store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    _skip_without_direct_io(store.root)
    seen = _writes_by_descriptor(monkeypatch)
    store = LocalStorage(store.root)
    a, b, c = os.urandom(8192), os.urandom(1000), os.urandom(4096)
    with store.open_writer("shards/s", head_size=512) as w:
        w.write(_aligned(a), keep=True)
        w.write(_aligned(a[:4096]).toreadonly()[1:513])  # aligned length, not address
        w.write(_aligned(b), keep=True)  # not a whole block: the position is odd after it
        w.write(_aligned(c), keep=True)
        w.finish(b"h" * 512)
    assert seen[:4] == [("direct", 8192), ("cached", 512), ("cached", 1000), ("cached", 4096)]
    assert store.read("shards/s") == b"h" * 512 + a + a[1:513] + b + c


def test_a_refused_direct_write_goes_through_the_page_cache(
    store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    _skip_without_direct_io(store.root)
    seen = _writes_by_descriptor(monkeypatch, fail_direct=True)
    store = LocalStorage(store.root)
    body = os.urandom(3 * 4096)
    with store.open_writer("shards/s", head_size=512) as w:
        w.write(_aligned(body), keep=True)
        w.write(_aligned(body), keep=True)
        w.finish(b"h" * 512)
    assert seen[:2] == [("cached", len(body)), ("cached", len(body))]
    assert not store.direct_io  # the storage's next objects do not try again
    assert store.read("shards/s") == b"h" * 512 + body + body


@pytest.mark.parametrize("take", [True, False])
def test_a_shard_of_whole_blocks_is_written_direct_and_reads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, take: bool
) -> None:
    import ml_dtypes
    import numpy as np

    from hsx.output import ShardWriter
    from hsx.output.shards import ShardReader, verify_shard

    _skip_without_direct_io(tmp_path)
    seen = _writes_by_descriptor(monkeypatch)
    rng = np.random.default_rng(0)
    samples = []
    for t in (3, 17, 64):  # [T, 4, 64] bf16: 512 bytes a token
        hs = rng.standard_normal((t, 4, 64), dtype=np.float32).astype(ml_dtypes.bfloat16)
        block = np.frombuffer(_aligned(hs.tobytes()), ml_dtypes.bfloat16).reshape(hs.shape)
        samples.append((np.arange(t), np.ones(t, np.uint8), block))
    with ShardWriter(tmp_path, 0, layers=[1, 2, 3, 4], hidden_size=64,
                     storage_dtype="bf16") as writer:
        for i, (ids, mask, hs) in enumerate(samples):
            writer.add(i, ids, mask, hs, take=take)
        record = writer.commit().record
    assert [n for how, n in seen if how == "direct"] == [t * 512 for t in (3, 17, 64)]
    store = LocalStorage(tmp_path)
    verify_shard(store, record)
    with ShardReader.open(store, record.shard, record=record) as reader:
        for i, (_, _, hs) in enumerate(samples):
            assert reader.sample(i)["hidden_states"].tobytes() == hs.tobytes()


def test_direct_io_is_off_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _writes_by_descriptor(monkeypatch)
    monkeypatch.delenv("HSX_DIRECT_IO")
    store = LocalStorage(tmp_path)
    with store.open_writer("x", head_size=512) as w:
        w.write(_aligned(b"z" * 4096), keep=True)
        w.finish(b"h" * 512)
    assert seen[0] == ("cached", 4096)


def test_crashed_writer_leaves_only_staging_files(store: LocalStorage) -> None:
    code = textwrap.dedent("""
        import os, sys
        from hsx.output import Storage
        w = Storage.for_uri(sys.argv[1]).open_writer("shards/s", head_size=8)
        w.write(b"z" * 100000)
        os._exit(9)  # no clean-up at all, as with kill -9
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(store.root)], cwd=REPO)
    assert proc.returncode == 9
    assert store.list() == []
    assert store.abort_incomplete_writes() == 1
    assert list((store.root / STAGING_DIR).iterdir()) == []


def test_check_writable(store: LocalStorage, tmp_path: Path) -> None:
    store.check_writable()
    assert store.list() == []
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match="not writable"):
        Storage.for_uri(blocker / "out").check_writable()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_check_writable_read_only(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(StorageError, match="not writable"):
            Storage.for_uri(ro).check_writable()
    finally:
        ro.chmod(0o700)


def test_local_storage_pickles(store: LocalStorage) -> None:
    store.put("a", b"1")
    again = pickle.loads(pickle.dumps(store))
    assert again.read("a") == b"1"


# --------------------------------------------------------------------------- S3 client


def _s3_client(handler: object, **kw: object) -> object:
    import httpx

    from hsx.output.s3_multipart import S3MultipartClient, S3Settings

    settings = S3Settings.resolve("bkt", {
        "endpoint": "http://127.0.0.1:9", "access_key_id": "k", "secret_access_key": "s",
        "allow_http": True, **kw,
    })
    client = S3MultipartClient(settings, "pre", max_attempts=3)
    client._http = httpx.Client(transport=httpx.MockTransport(handler))  # type: ignore[arg-type]
    client._pid = os.getpid()
    client._backoff = lambda attempt, why: None  # type: ignore[method-assign]
    return client


def test_s3_client_retries_transient_errors_and_signs() -> None:
    import httpx

    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) == 1:
            raise httpx.ConnectError("dropped")
        if len(seen) == 2:
            return httpx.Response(503, content=b"<Error><Code>SlowDown</Code></Error>")
        return httpx.Response(200, headers={"ETag": '"abc"'})

    client: Any = _s3_client(handler)
    etag = client.upload_part("shards/x", "up/1", 7, [memoryview(b"0123"), memoryview(b"45")])
    assert etag == '"abc"' and len(seen) == 3
    last = seen[-1]
    assert last.url.path == "/bkt/pre/shards/x"
    assert dict(last.url.params) == {"partNumber": "7", "uploadId": "up/1"}
    assert last.content == b"012345" and last.headers["content-length"] == "6"
    assert last.headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
    assert last.headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=k/")


def test_s3_client_errors_name_the_problem() -> None:
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":  # CompleteMultipartUpload: 200 with an error inside
            return httpx.Response(200, content=b'<?xml version="1.0"?>\n<Error><Code>'
                                  b"InvalidPart</Code><Message>bad etag</Message></Error>")
        return httpx.Response(403, content=b"<Error><Code>SignatureDoesNotMatch</Code></Error>")

    client: Any = _s3_client(handler)
    with pytest.raises(StorageError, match=r"access denied.*SignatureDoesNotMatch"):
        client.upload_part("k", "u", 1, b"x")
    with pytest.raises(StorageError, match="InvalidPart: bad etag"):
        client.complete_upload("k", "u", [(1, '"e"')], 1)


def test_s3_complete_whose_answer_was_lost_is_accepted() -> None:
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(404, content=b"<Error><Code>NoSuchUpload</Code></Error>")
        return httpx.Response(200, headers={"Content-Length": "11"})  # HEAD: it is there

    client: Any = _s3_client(handler)
    client.complete_upload("k", "u", [(1, '"e"')], 11)
    with pytest.raises(ObjectNotFoundError):
        client.complete_upload("k", "u", [(1, '"e"')], 12)  # another size: not ours


def test_s3_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from hsx.output.s3_multipart import S3Settings

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "envkey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envsecret")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    settings = S3Settings.resolve("b", {"access_key_id": "optkey"})
    assert settings.endpoint == "http://127.0.0.1:9" and settings.region == "eu-west-1"
    assert settings.access_key_id == "optkey" and settings.secret_access_key == "envsecret"
    assert settings.allow_http and settings.static
    assert "envsecret" not in repr(settings)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert S3Settings.resolve("b", {}).base_url() == ("https://b.s3.eu-west-1.amazonaws.com", "")


class _FakeMultipartS3:
    """The multipart calls of one bucket, in memory (an httpx MockTransport handler)."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[int, bytes]] = {}
        self.objects: dict[str, bytes] = {}
        self.order: list[int] = []
        self.sizes: dict[int, int] = {}

    def __call__(self, request: Any) -> Any:
        import httpx

        key, params = request.url.path, dict(request.url.params)
        if request.method == "POST" and "uploads" in params:
            self.parts["up"] = {}
            return httpx.Response(200, content=b"<R><UploadId>up</UploadId></R>")
        if request.method == "PUT" and "partNumber" in params:
            number = int(params["partNumber"])
            self.parts[params["uploadId"]][number] = request.read()
            self.order.append(number)
            self.sizes[number] = len(self.parts[params["uploadId"]][number])
            return httpx.Response(200, headers={"ETag": f'"{number}"'})
        if request.method == "POST":
            parts = self.parts.pop(params["uploadId"])
            self.objects[key] = b"".join(parts[n] for n in sorted(parts))
            return httpx.Response(200, content=b"<R/>")
        if request.method == "PUT":
            self.objects[key] = request.read()
            return httpx.Response(200)
        return httpx.Response(400)


@pytest.mark.parametrize("body_mib", [3, 23])
def test_s3_parts_writer_keeps_or_copies_and_sends_part_one_last(
    store: LocalStorage, body_mib: int
) -> None:
    import numpy as np

    from hsx.output.s3_multipart import MIN_PART_SIZE, S3PartsWriter

    s3 = _FakeMultipartS3()
    client: Any = _s3_client(s3)
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 255, n, dtype=np.uint8) for n in
              rng.integers(1, 2**20, 4 * body_mib)]
    body = np.concatenate(chunks).tobytes()[: body_mib * 2**20]
    part = MIN_PART_SIZE + 2**20
    writer = S3PartsWriter(store, client, "shards/x", 100, part_size=part, max_inflight=2)
    at = 0
    for i, chunk in enumerate(chunks):  # kept and copied writes, interleaved
        piece = chunk[: len(body) - at]
        if i % 3 == 0:
            scratch = bytearray(piece.tobytes())
            writer.write(scratch)
            scratch[:] = b"\0" * len(scratch)  # a copied write may be reused at once
        else:
            writer.write(piece, keep=True)
        at += len(piece)
    head = b"H" * 100
    assert writer.finish(head).size == len(head) + len(body)
    assert s3.objects["/bkt/pre/shards/x"] == head + body
    if body_mib * 2**20 + 100 <= part:
        assert s3.order == []  # one PUT
    else:
        assert sorted(s3.order) == list(range(1, len(s3.order) + 1))
        assert s3.order[0] != 1  # part 1 holds the head: it goes after the first parts
        sizes = [s3.sizes[n] for n in sorted(s3.sizes)]
        assert set(sizes[:-1]) == {part}  # equal parts but the last (R2 wants it)
