"""hsx.output storage on a real S3 server (SeaweedFS on loopback, one per session)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from hsx.output import (
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    Storage,
    StorageError,
)
from hsx.output.object_storage import (
    ObjectStoreStorage,
    ObstoreStreamWriter,
    StagedObjectWriter,
)
from hsx.output.s3_multipart import MIN_PART_SIZE, S3PartsWriter
from tests.s3server import SeaweedS3

pytestmark = pytest.mark.s3

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(s3_server: SeaweedS3, s3_uri: str) -> ObjectStoreStorage:
    st = Storage.for_uri(s3_uri, **s3_server.options)
    assert isinstance(st, ObjectStoreStorage)
    return st


def test_check_writable_passes_and_leaves_nothing(store: ObjectStoreStorage) -> None:
    store.check_writable()
    assert store.list() == []
    assert store.multipart is not None and store.multipart.list_uploads() == []


def test_credentials_come_from_the_environment(
    s3_server: SeaweedS3, s3_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    st = Storage.for_uri(s3_uri)
    st.check_writable()
    st.create("a", b"1")
    assert st.read("a") == b"1"


def test_create_race_has_exactly_one_winner(store: ObjectStoreStorage) -> None:
    n = 12
    barrier = threading.Barrier(n)

    def attempt(i: int) -> bool:
        barrier.wait()
        try:
            store.create("commits/unit-000003.json", f"attempt {i}".encode())
            return True
        except ObjectExistsError:
            return False

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(attempt, range(n)))
    assert results.count(True) == 1, results
    winner = results.index(True)
    assert store.read("commits/unit-000003.json") == f"attempt {winner}".encode()
    with pytest.raises(ObjectExistsError, match=r"commits/unit-000003\.json already exists"):
        store.create("commits/unit-000003.json", b"late")


def test_put_read_head_delete(store: ObjectStoreStorage) -> None:
    store.put("complete.json", b"one")
    store.put("complete.json", b"three")
    assert store.read("complete.json") == b"three"
    assert store.head("complete.json") == ObjectInfo("complete.json", 5)
    assert store.size("complete.json") == 5 and store.exists("complete.json")
    store.delete("complete.json")
    store.delete("complete.json")  # missing: fine
    assert store.head("complete.json") is None and not store.exists("complete.json")
    with pytest.raises(ObjectNotFoundError, match="does not exist"):
        store.read("complete.json")
    with pytest.raises(ObjectNotFoundError):
        store.size("complete.json")


def test_ranged_reads(store: ObjectStoreStorage) -> None:
    data = os.urandom(1 << 20)
    store.put("shards/blob", data)
    for start, length in [(0, 8), (12345, 4096), ((1 << 20) - 10, 10), (5, 0)]:
        assert bytes(store.read_range("shards/blob", start, length)) == data[
            start : start + length
        ]
    with pytest.raises(StorageError):
        store.read_range("shards/blob", (1 << 20) - 4, 8)
    with pytest.raises(ObjectNotFoundError):
        store.read_range("shards/missing", 0, 8)
    assert store.local_path("shards/blob") is None and not store.is_local


def test_list_by_folder_with_many_keys(store: ObjectStoreStorage) -> None:
    keys = [f"commits/unit-{i:06d}.json" for i in range(1100)]  # more than one page
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: store.put(k, b"{}"), keys))
    store.put("commitsX/other", b"x")
    store.put("manifest.json", b"{}")
    listed = store.list("commits")
    assert [i.key for i in listed] == keys
    assert all(i.size == 2 for i in listed)
    assert len(store.list()) == len(keys) + 2
    assert store.list("nothing") == []


def _body(n: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(seed.to_bytes(4, "little")).digest(n)


def test_large_object_streams_with_its_head_last(store: ObjectStoreStorage) -> None:
    """64 MiB in 1 MiB writes: parts 2..n upload while writing, part 1 (the head) last."""
    body = _body(64 * 2**20)
    head = b"H" * 65536
    with store.open_writer("shards/unit-000001-aa.safetensors", head_size=len(head)) as w:
        assert isinstance(w, S3PartsWriter)
        view = memoryview(body)
        for i in range(0, len(body), 1 << 20):
            w.write(view[i : i + (1 << 20)])
        assert store.list("shards") == []  # nothing visible before finish()
        info = w.finish(head)
    assert info.size == len(head) + len(body)
    assert store.size(info.key) == info.size
    got = store.read(info.key)
    assert hashlib.sha256(got).digest() == hashlib.sha256(head + body).digest()
    assert bytes(store.read_range(info.key, len(head) - 3, 6)) == b"HHH" + body[:3]
    assert store.multipart is not None and store.multipart.list_uploads() == []


def test_head_of_another_length_and_small_objects(store: ObjectStoreStorage) -> None:
    body = _body(MIN_PART_SIZE * 2 + 123, seed=1)
    with store.open_writer("shards/grown", head_size=100) as w:
        w.write(body)
        w.finish(b"h" * 5000)  # larger than reserved: part 1 just grows
    assert store.read("shards/grown") == b"h" * 5000 + body
    with store.open_writer("shards/small", head_size=4) as w:
        w.write(b"tiny body")
        w.finish(b"HEAD")  # fits in part 1: one plain PUT
    assert store.read("shards/small") == b"HEADtiny body"
    with store.open_writer("shards/empty", head_size=4) as w:
        w.finish(b"HEAD")
    assert store.read("shards/empty") == b"HEAD"


def test_aborted_stream_leaves_nothing(store: ObjectStoreStorage) -> None:
    body = _body(3 * MIN_PART_SIZE, seed=2)
    with pytest.raises(RuntimeError, match="engine died"), \
            store.open_writer("shards/s", head_size=64) as w:
        w.write(body)  # parts 2.. are uploading or uploaded
        raise RuntimeError("engine died")
    assert store.list() == []
    assert store.multipart is not None and store.multipart.list_uploads() == []


def test_crashed_writer_is_cleaned_up(s3_server: SeaweedS3, store: ObjectStoreStorage) -> None:
    code = textwrap.dedent("""
        import os, sys
        from hsx.output import Storage
        st = Storage.for_uri(sys.argv[1], part_size=5 * 2**20)
        w = st.open_writer("shards/s", head_size=64)
        w.write(os.urandom(3 * 5 * 2**20))
        w._futures[-1].result()  # a part is in the bucket
        os._exit(9)  # no abort at all, as with kill -9
    """)
    env = {**os.environ, **s3_server.env}
    proc = subprocess.run([sys.executable, "-c", code, store.uri], cwd=REPO, env=env)
    assert proc.returncode == 9
    assert store.list() == []
    assert store.multipart is not None and len(store.multipart.list_uploads()) == 1
    assert store.abort_incomplete_writes() == 1
    assert store.multipart.list_uploads() == []


@pytest.mark.parametrize("writer_cls", [ObstoreStreamWriter, StagedObjectWriter])
def test_obstore_writers(
    s3_server: SeaweedS3, s3_uri: str, writer_cls: type[ObstoreStreamWriter | StagedObjectWriter]
) -> None:
    """The paths used without part-numbered uploads (gs://, az://, instance roles)."""
    st = Storage.for_uri(s3_uri, part_size=MIN_PART_SIZE, **s3_server.options)
    assert isinstance(st, ObjectStoreStorage)
    st.multipart = None  # as when obstore resolves credentials that hsx cannot see
    head_size = 0 if writer_cls is ObstoreStreamWriter else 32
    body = _body(3 * MIN_PART_SIZE + 5, seed=3)
    with st.open_writer("shards/s", head_size=head_size) as w:
        assert type(w) is writer_cls
        w.write(body[: MIN_PART_SIZE * 2])
        w.write(body[MIN_PART_SIZE * 2 :])
        assert st.list("shards") == []
        w.finish(b"x" * head_size)
    assert st.read("shards/s") == b"x" * head_size + body
    with pytest.raises(RuntimeError, match="stop"), \
            st.open_writer("shards/t", head_size=head_size) as w:
        w.write(body)
        raise RuntimeError("stop")
    assert [i.key for i in st.list()] == ["shards/s"]
    lister = Storage.for_uri(s3_uri, **s3_server.options)
    assert isinstance(lister, ObjectStoreStorage) and lister.multipart is not None
    assert lister.multipart.list_uploads() == []


def test_storage_pickles_for_other_processes(store: ObjectStoreStorage) -> None:
    store.put("manifest.json", b"{}")
    again = pickle.loads(pickle.dumps(store))
    assert again.uri == store.uri and again.read("manifest.json") == b"{}"
    with again.open_writer("shards/p", head_size=2) as w:
        w.write(b"body")
        w.finish(b"hd")
    assert store.read("shards/p") == b"hdbody"


def test_missing_bucket_is_named(s3_server: SeaweedS3) -> None:
    st = Storage.for_uri("s3://no-such-bucket-hsx/out", **s3_server.options)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-hsx' does not exist"):
        st.check_writable()


def test_bad_credentials_are_named(s3_server: SeaweedS3, s3_uri: str) -> None:
    for bad in ({"secret_access_key": "wrong"}, {"access_key_id": "nobody"}):
        st = Storage.for_uri(s3_uri, **{**s3_server.options, **bad})
        with pytest.raises(StorageError, match="denied; check the credentials"):
            st.check_writable()


def test_unreachable_endpoint_fails_early() -> None:
    st = Storage.for_uri(
        "s3://bucket/out", endpoint="http://127.0.0.1:9", access_key_id="k",
        secret_access_key="s", allow_http=True,
    )
    with pytest.raises(StorageError, match=r"cannot reach http://127\.0\.0\.1:9"):
        st.check_writable()


def test_keys_with_every_allowed_character(store: ObjectStoreStorage) -> None:
    """Keys are signed as S3 encodes them, through obstore and through the part writer."""
    key = "draft/checkpoints/step=1+a@b,c-d_e.f"
    store.create(key, b"small")
    with store.open_writer(key + ".big", head_size=3) as w:
        w.write(_body(MIN_PART_SIZE + 1, seed=4))  # a real multipart upload
        w.finish(b"hdr")
    assert store.read(key) == b"small"
    assert store.size(key + ".big") == MIN_PART_SIZE + 4
    assert [i.key for i in store.list("draft")] == [key, key + ".big"]
