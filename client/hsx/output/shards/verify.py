"""`verify_shard`: a committed shard checked against its commit record, byte for byte."""

from __future__ import annotations

import json
import struct

from hsx.output.records import CommitRecord
from hsx.output.shards.encoding import CHECKSUM_SCHEME, HEADER_PREFIX, ShardCorrupt, new_hasher
from hsx.output.shards.reader import ByteSource, ShardReader
from hsx.output.storage import Storage


def verify_shard(storage: Storage, record: CommitRecord) -> None:
    """Check a committed shard against its record's size and checksums; raise ShardCorrupt.

    Reads the whole shard once: from the file on local disk, by ranged reads (16 MiB
    each) from an object store. Under the `samples` scheme the data digest covers the
    bytes after hidden_states and each sample's rows are checked against its digest;
    under `whole` (older records) the data digest covers the whole data section.
    """
    what = f"shard {storage.url(record.shard)} (unit {record.unit})"
    info = storage.head(record.shard)
    if info is None:
        raise ShardCorrupt(f"{what} is missing")
    size = info.size
    if size != record.bytes:
        raise ShardCorrupt(f"{what} has {size} bytes, its commit record says {record.bytes}")
    if size < HEADER_PREFIX:
        raise ShardCorrupt(f"{what} is truncated")
    algorithm, header_digest, data_digest = record.checksums()
    scheme = record.checksum_scheme()
    if scheme not in ("whole", CHECKSUM_SCHEME):
        raise ShardCorrupt(f"{what}: checksum scheme {scheme!r} is unknown; upgrade hsx")
    try:
        header_sha, data_sha = new_hasher(algorithm), new_hasher(algorithm)
    except ValueError as err:
        raise ShardCorrupt(f"{what}: {err}") from None
    with ByteSource.open(storage, record.shard, size) as source:
        prefix = source.read(0, HEADER_PREFIX)
        (n,) = struct.unpack("<Q", prefix)
        if HEADER_PREFIX + n > size:
            raise ShardCorrupt(f"{what}: header checksum mismatch (header length {n} is corrupt)")
        header = source.read(HEADER_PREFIX, n)
        header_sha.update(prefix)
        header_sha.update(header)
        if header_sha.hexdigest() != header_digest:
            raise ShardCorrupt(f"{what}: header checksum mismatch")
        start = HEADER_PREFIX + n
        if scheme == CHECKSUM_SCHEME:
            start += int(json.loads(bytes(header))["hidden_states"]["data_offsets"][1])
        source.hash_range(start, size - start, data_sha)
        if data_sha.hexdigest() != data_digest:
            raise ShardCorrupt(f"{what}: data checksum mismatch")
        if scheme == CHECKSUM_SCHEME:
            with ShardReader(source, record=record) as reader:  # closing it closes source
                if reader.sample_digests is None:
                    raise ShardCorrupt(f"{what}: the record's checksum needs sample digests "
                                       "and the shard has none")
                if reader.failing_samples():
                    raise ShardCorrupt(f"{what}: data checksum mismatch")
