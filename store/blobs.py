"""Blob storage for uploaded and generated files: a local directory (embedded) or S3 (distributed).

Both stores stream: `put` consumes an iterable of chunks and `open` yields chunks, so no file
ever sits whole in memory. A `put` that fails part-way leaves nothing under its key, and an
existing object under that key is replaced only by a complete new one.

S3 calls ride out a restart of the S3 server (pagedbatch.store.retry): each request that is safe
to repeat (a whole PUT, one part, a GET, a HEAD, a DELETE) is retried on its own; a `put` never
re-reads its chunks, which it may not be able to.

Keys are relative '/'-separated names the service makes up, such as "files/file-abc123"; no name
in a key may be empty or start with '.'. A missing key makes `open` and `size` raise
`BlobNotFoundError`, a `FileNotFoundError`; `exists` answers False and `delete` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from pagedbatch.settings import Settings
from pagedbatch.store.retry import retrying

MiB = 1 << 20
CHUNK_SIZE = MiB  # what a reader yields at a time
PART_SIZE = 8 * MiB  # S3 multipart part
MIN_PART_SIZE = 5 * MiB  # S3's floor for every part but the last


class BlobNotFoundError(FileNotFoundError):
    def __init__(self, key: str) -> None:
        super().__init__(f"no blob with key {key!r}")
        self.key = key


class _Stream(Protocol):
    def read(self, size: int, /) -> bytes: ...

    def close(self) -> None: ...


class BlobReader(Iterator[bytes]):
    """A blob's bytes in chunks of at most `chunk_size`.

    Reaching the end, an error, or `close()` (also on leaving a `with` block) releases the
    underlying file or HTTP response; close a reader you stop reading early.
    """

    def __init__(self, stream: _Stream, chunk_size: int = CHUNK_SIZE) -> None:
        self._stream = stream
        self._chunk_size = chunk_size
        self._closed = False

    def __next__(self) -> bytes:
        if self._closed:
            raise StopIteration
        try:
            chunk = self._stream.read(self._chunk_size)
        except BaseException:
            self.close()
            raise
        if not chunk:
            self.close()
            raise StopIteration
        return chunk

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stream.close()

    def __enter__(self) -> BlobReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class BlobStore(Protocol):
    def put(self, key: str, chunks: Iterable[bytes]) -> int:
        """Store the concatenated chunks under `key`, replacing any object there; the size."""
        ...

    def open(self, key: str) -> BlobReader:
        """The object's bytes, in chunks; raises `BlobNotFoundError` at once when missing."""
        ...

    def size(self, key: str) -> int: ...

    def delete(self, key: str) -> None: ...

    def exists(self, key: str) -> bool: ...


def _check_key(key: str) -> str:
    # No '.' names: keys cannot climb out of the local root with '..', nor meet its temp files.
    names = key.split("/")
    if not all(names) or any(name.startswith(".") for name in names):
        raise ValueError(
            f"bad blob key {key!r}: want '/'-separated names, none empty or starting with '.'"
        )
    return key


class LocalBlobStore:
    """Blobs as files under `root`; the '/' in keys make subdirectories."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put(self, key: str, chunks: Iterable[bytes]) -> int:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Same directory, so the final rename is atomic; a dot name, so no key ever names it.
        fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        temp = Path(temp_name)
        try:
            written = 0
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    written += len(chunk)
                out.flush()
                # The caller records the key once we return: it must survive a crash.
                os.fsync(out.fileno())
            temp.replace(path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
        return written

    def open(self, key: str) -> BlobReader:
        try:
            return BlobReader(self._path(key).open("rb"))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise BlobNotFoundError(key) from None

    def size(self, key: str) -> int:
        try:
            info = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            raise BlobNotFoundError(key) from None
        if not stat.S_ISREG(info.st_mode):
            raise BlobNotFoundError(key)
        return info.st_size

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class S3BlobStore:
    """Blobs as objects in an S3 bucket, made at construction when missing.

    Credentials and region come from boto3's usual sources (`AWS_ACCESS_KEY_ID`,
    `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`, ...), read when the store is made.
    """

    def __init__(
        self,
        bucket: str,
        endpoint_url: str | None = None,
        addressing_style: str = "path",
        part_size: int = PART_SIZE,
    ) -> None:
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"S3 parts are at least {MIN_PART_SIZE} bytes, not {part_size}")
        self.bucket = bucket
        self.part_size = part_size
        # A session of our own: boto3's default one caches the credentials it first found.
        self._s3 = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            # One try a call: outages are retried here, for a known while, not also inside boto.
            config=BotoConfig(
                s3={"addressing_style": addressing_style}, retries={"total_max_attempts": 1}
            ),
        )
        self._ensure_bucket()

    def _ensure_bucket(self) -> None:
        try:
            retrying(lambda: self._s3.head_bucket(Bucket=self.bucket), f"looking for {self.bucket}")
            return
        except ClientError as exc:
            if not _is_missing(exc):
                raise
        region = self._s3.meta.region_name
        location = (
            {}
            if region in (None, "us-east-1")
            else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        )
        try:
            retrying(
                lambda: self._s3.create_bucket(Bucket=self.bucket, **location),
                f"creating {self.bucket}",
            )
        except ClientError as exc:
            # Another replica made it between our look and our create.
            if exc.response["Error"]["Code"] != "BucketAlreadyOwnedByYou":
                raise

    def put(self, key: str, chunks: Iterable[bytes]) -> int:
        _check_key(key)
        parts = _parts(chunks, self.part_size)
        part = next(parts, b"")
        if len(part) < self.part_size:  # the whole object: one plain PUT
            retrying(
                lambda: self._s3.put_object(Bucket=self.bucket, Key=key, Body=part),
                f"writing {key}",
            )
            return len(part)
        upload_id = retrying(
            lambda: self._s3.create_multipart_upload(Bucket=self.bucket, Key=key),
            f"starting to write {key}",
        )["UploadId"]
        try:
            done: list[dict[str, object]] = []
            written = 0
            while part:
                done.append(self._upload_part(key, upload_id, len(done) + 1, part))
                written += len(part)
                part = b""  # free this part before the next one fills
                part = next(parts, b"")
            retrying(
                lambda: self._s3.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": done},
                ),
                f"finishing writing {key}",
            )
        except BaseException:
            # An unfinished upload is invisible, but its parts take space until aborted. Should
            # the abort fail too, the first error is the one to report.
            with contextlib.suppress(BotoCoreError, ClientError):
                self._s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise
        return written

    def _upload_part(self, key: str, upload_id: str, number: int, part: bytes) -> dict[str, object]:
        """Upload one part (again, after a failure: the same number replaces it)."""
        response = retrying(
            lambda: self._s3.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=part
            ),
            f"writing part {number} of {key}",
        )
        return {"PartNumber": number, "ETag": response["ETag"]}

    def open(self, key: str) -> BlobReader:
        _check_key(key)
        try:
            response = retrying(
                lambda: self._s3.get_object(Bucket=self.bucket, Key=key), f"reading {key}"
            )
        except ClientError as exc:
            if _is_missing(exc):
                raise BlobNotFoundError(key) from None
            raise
        return BlobReader(response["Body"])

    def size(self, key: str) -> int:
        _check_key(key)
        try:
            response = retrying(
                lambda: self._s3.head_object(Bucket=self.bucket, Key=key), f"looking at {key}"
            )
        except ClientError as exc:
            if _is_missing(exc):
                raise BlobNotFoundError(key) from None
            raise
        return response["ContentLength"]

    def delete(self, key: str) -> None:
        # S3 answers a delete of a missing key with success.
        _check_key(key)
        retrying(lambda: self._s3.delete_object(Bucket=self.bucket, Key=key), f"deleting {key}")

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except BlobNotFoundError:
            return False
        return True


def _is_missing(exc: ClientError) -> bool:
    # HEAD answers carry no error code to read, only the status.
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404


def _parts(chunks: Iterable[bytes], size: int) -> Iterator[bytes]:
    """The chunks' bytes re-cut into pieces of `size`, the last one shorter and never empty."""
    buffer = bytearray()
    for chunk in chunks:
        buffer += chunk
        while len(buffer) >= size:
            # A new buffer for the rest: cutting the front off a bytearray keeps its memory.
            with memoryview(buffer) as view:
                part, buffer = bytes(view[:size]), bytearray(view[size:])
            yield part
            del part  # the consumer is done with it: free it before the next fills
    if buffer:
        yield bytes(buffer)


def make_blob_store(settings: Settings) -> BlobStore:
    """S3 when a bucket is configured, else a directory in the data dir."""
    if settings.s3_bucket:
        return S3BlobStore(
            settings.s3_bucket, settings.s3_endpoint_url, settings.s3_addressing_style
        )
    return LocalBlobStore(settings.data_dir / "files")
