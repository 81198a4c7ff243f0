"""The S3 backend: blobs as objects `<prefix>blobs/sha256/<hex>` in a bucket, via boto3.

Credentials, region and profile come from the usual AWS configuration (environment
variables, ~/.aws/config and credentials, instance roles); `endpoint_url` points it at
any S3-protocol server (MinIO, Ceph, moto). Uploads use multipart above 64 MiB.

Capacity: None (the default) leaves the bucket unbounded (use a lifecycle rule to expire
old blobs). With a capacity, the backend lists the prefix at start and evicts the least
recently used objects (by its own reads, else by LastModified) before an upload would
exceed it. That bound is per region server: several servers sharing one prefix each
enforce their own view, so give each its own prefix or rely on a lifecycle rule.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import threading
from collections.abc import Generator
from pathlib import Path

from cache.content import process_start
from cache.region.backends import (
    Backend,
    BackendError,
    BlobNotFound,
    BlobStream,
    check_range,
    register,
)
from shoal.digest import check_digest

_MULTIPART = 64 << 20


def _boto():
    import boto3
    import boto3.exceptions
    import botocore.config
    import botocore.exceptions

    return boto3, botocore.config, botocore.exceptions


def _nothing() -> Generator[bytes, None, None]:
    yield from ()


class _BodyStream:
    """Iterator over a get_object body; releases the read guard when done."""

    def __init__(self, body, want: int, block: int, what: str, release, errors) -> None:
        self._body, self._left, self._block, self._what = body, want, block, what
        self._release, self._errors = release, errors

    def __iter__(self) -> _BodyStream:
        return self

    def __next__(self) -> bytes:
        if self._body is None or self._left <= 0:
            self.close()
            raise StopIteration
        try:
            data = self._body.read(min(self._block, self._left))
        except (self._errors.BotoCoreError, OSError) as exc:
            self.close()
            raise BackendError(f"{self._what}: read failed: {exc}") from None
        if not data:
            self.close()
            raise BackendError(f"{self._what}: object ended {self._left} bytes early")
        self._left -= len(data)
        return data

    def close(self) -> None:
        if self._body is not None:
            with contextlib.suppress(Exception):
                self._body.close()
            self._body = None
            self._release()

    def __del__(self) -> None:
        self.close()


@register("s3")
class S3Backend(Backend):
    """Blobs in s3://bucket/prefix (see the module doc).

    staging: a local directory for blobs being filled before upload (temp_path()).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "shoal/",
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        capacity: int | None = None,
        create_bucket: bool = False,
        staging: str | os.PathLike | None = None,
    ) -> None:
        boto3, config, self._errors = _boto()
        self._upload_failed = boto3.exceptions.S3UploadFailedError
        if not bucket:
            raise ValueError("s3 backend: a bucket is required")
        self.bucket, self.prefix = bucket, prefix
        self.capacity = capacity or None
        session = boto3.session.Session(profile_name=profile or None, region_name=region or None)
        self._s3 = session.client(
            "s3", endpoint_url=endpoint_url or None,
            config=config.Config(retries={"max_attempts": 3, "mode": "standard"},
                                 connect_timeout=5, read_timeout=60, max_pool_connections=64),
        )
        from boto3.s3.transfer import TransferConfig

        self._transfer = TransferConfig(multipart_threshold=_MULTIPART, multipart_chunksize=_MULTIPART,
                                        max_concurrency=8)
        self._where = f"s3 backend s3://{bucket}/{prefix}"
        self._staging = Path(staging) if staging else Path(os.environ.get("TMPDIR", "/tmp")) / "shoal-s3-staging"
        self._staging.mkdir(parents=True, exist_ok=True)
        self._token = f"{os.getpid()}.{process_start(os.getpid()) or 0}."
        self._clean_staging()
        self._lock = threading.Lock()
        self._reading: collections.Counter[str] = collections.Counter()
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()  # digest -> size
        self._used = 0  # bytes of indexed objects plus reservations of running uploads
        self.counters = collections.Counter(evictions=0, rejected=0)
        if create_bucket:
            self._create_bucket(region)
        if self.capacity:
            self._load_index()

    # --- helpers ----------------------------------------------------------------------

    def _key(self, digest: str) -> str:
        return f"{self.prefix}blobs/sha256/{check_digest(digest)[7:]}"

    def _fail(self, exc: Exception, digest: str | None, doing: str) -> Exception:
        """BlobNotFound for a missing object, else BackendError (one line)."""
        what = f"{self._where}: blob {digest}" if digest else self._where
        if isinstance(exc, self._errors.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            if code in ("404", "NoSuchKey", "NotFound"):
                return BlobNotFound(f"{what}: not found")
            if code == "InvalidRange":
                return BackendError(f"{what}: {doing}: range not satisfiable")
            return BackendError(f"{what}: {doing}: {code} {err.get('Message', '')}".rstrip())
        return BackendError(f"{what}: {doing}: {exc}")

    def _clean_staging(self) -> None:
        for entry in os.scandir(self._staging):
            pid, _, rest = entry.name.partition(".")
            start = rest.partition(".")[0]
            if not (pid.isdigit() and start.isdigit() and process_start(int(pid)) == int(start)):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)

    def _create_bucket(self, region: str | None) -> None:
        try:
            self._s3.head_bucket(Bucket=self.bucket)
            return
        except self._errors.ClientError:
            pass
        except self._errors.BotoCoreError as exc:
            raise self._fail(exc, None, "head bucket") from None
        kwargs: dict[str, object] = {"Bucket": self.bucket}
        if region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self._s3.create_bucket(**kwargs)
        except (self._errors.ClientError, self._errors.BotoCoreError) as exc:
            raise self._fail(exc, None, "create bucket") from None

    def _load_index(self) -> None:
        found = []
        try:
            pages = self._s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=f"{self.prefix}blobs/sha256/")
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"].rsplit("/", 1)[-1]
                    found.append((obj["LastModified"], "sha256:" + name, obj["Size"]))
        except (self._errors.ClientError, self._errors.BotoCoreError) as exc:
            raise self._fail(exc, None, "list objects") from None
        for _, digest, size in sorted(found):
            self._lru[digest] = size
            self._used += size

    def _touch(self, digest: str, size: int | None = None) -> None:
        with self._lock:
            if digest in self._lru:
                self._lru.move_to_end(digest)
            elif size is not None and self.capacity:
                # an object another server put there: count it from now on
                self._lru[digest] = size
                self._used += size

    def _reserve(self, digest: str, size: int) -> bool:
        """Make room for `size` bytes (evicting LRU objects) and count them as used.
        Called only with a capacity."""
        capacity = self.capacity or 0
        with self._lock:
            if size > capacity:
                return False
            need, freed, victims = self._used + size - capacity, 0, []
            if need > 0:
                for d, s in self._lru.items():
                    if self._reading[d] or d == digest:
                        continue
                    victims.append(d)
                    freed += s
                    if freed >= need:
                        break
                if freed < need:
                    return False
                for v in victims:
                    self._used -= self._lru.pop(v)
            self._used += size
        for victim in victims:
            try:
                self._s3.delete_object(Bucket=self.bucket, Key=self._key(victim))
            except (self._errors.ClientError, self._errors.BotoCoreError) as exc:
                # already uncounted: the object stays until a restart lists and evicts it
                raise self._fail(exc, victim, "evict") from None
            self.counters["evictions"] += 1
        return True

    # --- the API ------------------------------------------------------------------------

    def size(self, digest: str) -> int:
        with self._lock:
            if digest in self._lru:
                return self._lru[digest]
        try:
            head = self._s3.head_object(Bucket=self.bucket, Key=self._key(digest))
        except (self._errors.ClientError, self._errors.BotoCoreError) as exc:
            raise self._fail(exc, digest, "head") from None
        size = int(head["ContentLength"])
        self._touch(digest, size)
        return size

    def stream(self, digest: str, start: int = 0, end: int | None = None, block: int = 1 << 20) -> BlobStream:
        size = self.size(digest)
        end = check_range(digest, size, start, end)
        with self._lock:
            self._reading[digest] += 1

        def release() -> None:
            with self._lock:
                self._reading[digest] -= 1
                if not self._reading[digest]:
                    del self._reading[digest]

        if start == end:
            release()
            return _nothing()
        try:
            resp = self._s3.get_object(Bucket=self.bucket, Key=self._key(digest), Range=f"bytes={start}-{end - 1}")
        except (self._errors.ClientError, self._errors.BotoCoreError) as exc:
            release()
            raise self._fail(exc, digest, "get") from None
        self._touch(digest)
        return _BodyStream(resp["Body"], end - start, block, f"{self._where}: blob {digest}", release, self._errors)

    def put_file(self, digest: str, path: str | os.PathLike) -> bool:
        key = self._key(digest)
        try:
            size = os.stat(path).st_size
            if self.contains(digest):
                self._touch(digest)
                return True
            if self.capacity and not self._reserve(digest, size):
                self.counters["rejected"] += 1
                return False
            try:
                self._s3.upload_file(str(path), self.bucket, key, Config=self._transfer)
            except (self._errors.ClientError, self._errors.BotoCoreError, self._upload_failed) as exc:
                if self.capacity:
                    with self._lock:
                        self._used -= size
                raise self._fail(exc, digest, "upload") from None
            if self.capacity:
                with self._lock:
                    self._lru[digest] = size  # reserved bytes become the object's
                    self._lru.move_to_end(digest)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def contains(self, digest: str) -> bool:
        with self._lock:
            if digest in self._lru:
                return True
        try:
            self.size(digest)
            return True
        except BlobNotFound:
            return False

    def delete(self, digest: str) -> bool:
        present = self.contains(digest)
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self._key(digest))
        except (self._errors.ClientError, self._errors.BotoCoreError) as exc:
            raise self._fail(exc, digest, "delete") from None
        with self._lock:
            if digest in self._lru:
                self._used -= self._lru.pop(digest)
        return present

    def temp_path(self) -> str:
        return str(self._staging / f"{self._token}{secrets.token_hex(8)}")

    def statistics(self) -> dict:
        with self._lock:
            return {
                "backend": "s3", "bucket": self.bucket, "prefix": self.prefix,
                "size_bytes": self._used if self.capacity else None,
                "capacity_bytes": self.capacity, "blobs": len(self._lru) if self.capacity else None,
                "evictions": self.counters["evictions"], "rejected": self.counters["rejected"],
            }

    def close(self) -> None:
        self._s3.close()
