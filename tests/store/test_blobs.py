"""Both blob stores, the local directory and S3 (a real SeaweedFS server), keep one contract."""

from __future__ import annotations

import hashlib
import random
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from services import S3Server

from pagedbatch.settings import Settings
from pagedbatch.store.blobs import (
    CHUNK_SIZE,
    MIN_PART_SIZE,
    BlobNotFoundError,
    BlobStore,
    LocalBlobStore,
    S3BlobStore,
    make_blob_store,
)

MiB = 1 << 20
PART_SIZE = MIN_PART_SIZE  # the smallest S3 allows, so a modest object takes many parts
BIG = 6 * PART_SIZE + 12345  # seven parts, the last a short one


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "local":
        return LocalBlobStore(tmp_path / "blobs")
    bucket: str = request.getfixturevalue("s3_settings_env")
    server: S3Server = request.getfixturevalue("s3_server")
    return S3BlobStore(bucket, server.endpoint_url, part_size=PART_SIZE)


def generated(size: int, seed: int = 0, chunk_size: int = MiB) -> Iterator[bytes]:
    """`size` pseudo-random bytes, made a chunk at a time as they are asked for."""
    rng = random.Random(seed)
    for start in range(0, size, chunk_size):
        yield rng.randbytes(min(chunk_size, size - start))


def digest(chunks: Iterator[bytes]) -> str:
    sha = hashlib.sha256()
    for chunk in chunks:
        sha.update(chunk)
    return sha.hexdigest()


def failing_after(size: int) -> Iterator[bytes]:
    yield from generated(size)
    raise RuntimeError("the upload broke off")


def test_a_multipart_object_round_trips_in_bounded_memory(store: BlobStore) -> None:
    tracemalloc.start()
    try:
        assert store.put("files/big", generated(BIG)) == BIG
        _, put_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        read_back = digest(store.open("files/big"))
        _, read_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert read_back == digest(generated(BIG))
    assert store.size("files/big") == BIG
    # About two parts in memory (one uploading, the next filling), never the whole object.
    assert put_peak < 3 * PART_SIZE
    assert read_peak < 4 * CHUNK_SIZE


def test_open_streams_chunks_and_close_releases_the_reader(store: BlobStore) -> None:
    data = b"".join(generated(2 * CHUNK_SIZE + 7))
    store.put("files/medium", [data])

    with store.open("files/medium") as reader:
        chunks = list(reader)
    assert [len(c) for c in chunks] == [CHUNK_SIZE, CHUNK_SIZE, 7]
    assert b"".join(chunks) == data

    reader = store.open("files/medium")
    assert next(reader) == data[:CHUNK_SIZE]
    reader.close()
    assert list(reader) == []


@pytest.mark.parametrize("data", [b"", b"{}\n"])
def test_small_and_empty_objects_round_trip(store: BlobStore, data: bytes) -> None:
    assert store.put("tiny", [data]) == len(data)
    assert b"".join(store.open("tiny")) == data
    assert store.size("tiny") == len(data)
    assert store.exists("tiny")


def test_put_replaces_an_object(store: BlobStore) -> None:
    store.put("files/a", [b"old"])
    store.put("files/a", [b"new", b"er"])
    assert b"".join(store.open("files/a")) == b"newer"


def test_a_missing_key_is_not_found(store: BlobStore) -> None:
    with pytest.raises(BlobNotFoundError, match="files/nothing") as raised:
        store.open("files/nothing")
    assert isinstance(raised.value, FileNotFoundError)
    assert raised.value.key == "files/nothing"
    with pytest.raises(BlobNotFoundError):
        store.size("files/nothing")
    assert not store.exists("files/nothing")
    store.delete("files/nothing")  # nothing to do, and no error


def test_delete_removes_the_object(store: BlobStore) -> None:
    store.put("files/doomed", [b"x"])
    store.delete("files/doomed")
    assert not store.exists("files/doomed")
    with pytest.raises(BlobNotFoundError):
        store.open("files/doomed")


@pytest.mark.parametrize("size", [100, BIG], ids=["single-part", "multipart"])
def test_a_put_that_breaks_off_leaves_no_object(store: BlobStore, size: int) -> None:
    with pytest.raises(RuntimeError, match="broke off"):
        store.put("files/partial", failing_after(size))

    assert not store.exists("files/partial")
    assert leftovers(store) == []


def test_a_put_that_breaks_off_keeps_the_object_it_would_replace(store: BlobStore) -> None:
    store.put("files/kept", [b"intact"])
    with pytest.raises(RuntimeError, match="broke off"):
        store.put("files/kept", failing_after(BIG))
    assert b"".join(store.open("files/kept")) == b"intact"
    assert leftovers(store) == []


def leftovers(store: BlobStore) -> list[str]:
    """What a broken put might leave behind: temp files, or multipart uploads not aborted."""
    if isinstance(store, LocalBlobStore):
        return [str(p.relative_to(store.root)) for p in store.root.rglob(".*")]
    assert isinstance(store, S3BlobStore)
    uploads = store._s3.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])
    return [upload["Key"] for upload in uploads]


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "../up", "files/../../up", ".hidden", "a/"])
def test_keys_must_be_plain_relative_names(store: BlobStore, key: str) -> None:
    with pytest.raises(ValueError, match="bad blob key"):
        store.put(key, [b"x"])
    with pytest.raises(ValueError, match="bad blob key"):
        store.open(key)


def test_settings_without_a_bucket_keep_files_in_the_data_dir(tmp_path: Path) -> None:
    store = make_blob_store(Settings(data_dir=tmp_path))
    assert isinstance(store, LocalBlobStore)
    store.put("files/f", [b"x"])
    assert (tmp_path / "files" / "files" / "f").read_bytes() == b"x"


def test_settings_with_a_bucket_keep_files_in_s3(s3_settings_env: str, s3_server: S3Server) -> None:
    store = make_blob_store(Settings())
    assert isinstance(store, S3BlobStore)
    assert store.bucket == s3_settings_env

    store.put("files/f", [b"x"])
    stored = s3_server.client().get_object(Bucket=s3_settings_env, Key="files/f")
    assert stored["Body"].read() == b"x"
