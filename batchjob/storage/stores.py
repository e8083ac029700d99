"""Where a job's files live: local paths (as always) or an object store (``s3://``, ``gs://``,
``hdfs://`` or any other scheme pyarrow.fs or fsspec knows).

Paths: a local path stays a ``pathlib.Path``; a URI is an ``ObjectPath`` (pure: joins and
names, no I/O). ``store_for(path)`` gives the operations the write path needs (read, write,
list, delete) for either kind, so ``output_layout``, ``results``, ``manifest`` and ``lock`` run
one protocol on both:

- ``LocalStore``: local files, as always.
- ``ObjectStore``: pyarrow.fs. One PUT is atomic per object (readers see the old object or the
  whole new one), but there is no rename: the results commit writes parts under unique names
  and makes a folder complete by writing the manifest and ``_SUCCESS`` last (``results``).

Writes of either kind go through ``batchjob.storage.atomic`` (temp file + rename locally, one PUT on
an object store), so the plan and report writers need no change.

Filesystems come from pyarrow.fs (S3 natively; ``gs://``, ``hdfs://`` via ``from_uri``; any
other fsspec protocol wrapped in ``PyFileSystem(FSSpecHandler)``). S3 settings, one source each
in this order: the ``[storage]`` section (``endpoint_url``, ``region``, ``anonymous``,
``options`` passed to ``pyarrow.fs.S3FileSystem``), then the standard environment variables
(``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``);
credentials come from the AWS chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, ``~/.aws``, instance roles). ``configure(job.storage)`` sets them for the
process (``load_job`` and ``pipeline.run`` do).

Stdlib only at import time (the config imports ``ObjectPath``); pyarrow is imported on use.
"""

from __future__ import annotations

import fnmatch
import json
import os
import posixpath
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

    from batchjob.storage.settings import StorageConfig

__all__ = [
    "LocalStore",
    "ObjectPath",
    "ObjectStore",
    "arrow_source",
    "configure",
    "filesystem",
    "is_uri",
    "store_for",
]

_S3_SCHEMES = ("s3", "s3a")


def is_uri(p: object) -> bool:
    """``s3://b/k``, ``gs://...``: True; a local path (``file://`` included) False."""
    s = str(p)
    scheme, sep, _ = s.partition("://")
    return bool(sep) and scheme.isascii() and scheme.replace("+", "").isalnum() and scheme != "file"


class ObjectPath:
    """``scheme://bucket/key``: the pure-path subset the layout uses (``/``, name, stem,
    suffix, parent, with_name). Deliberately not ``os.PathLike``: ``open()`` refuses it.
    Immutable and hashable; not a dataclass (``dataclasses.asdict`` keeps it whole)."""

    __slots__ = ("uri",)
    uri: str

    def __init__(self, uri: str):
        scheme, _, rest = str(uri).partition("://")
        rest = posixpath.normpath(rest.strip("/")) if rest.strip("/") else ""
        object.__setattr__(self, "uri", f"{scheme}://{rest}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ObjectPath is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    def __repr__(self) -> str:
        return f"ObjectPath({self.uri!r})"

    def __str__(self) -> str:
        return self.uri

    def __reduce__(self) -> tuple[Any, ...]:
        return (ObjectPath, (self.uri,))

    @property
    def scheme(self) -> str:
        return self.uri.partition("://")[0]

    @property
    def key(self) -> str:
        """The filesystem path: ``bucket/key`` (what pyarrow.fs takes)."""
        return self.uri.partition("://")[2]

    @property
    def bucket(self) -> str:
        return self.key.partition("/")[0]

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(f"{self.uri}/{name}")

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(f"{self.scheme}://{posixpath.dirname(self.key)}")

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    def with_suffix(self, suffix: str) -> ObjectPath:
        return self.with_name(self.stem + suffix)

    def is_relative_to(self, other: ObjectPath) -> bool:
        return self.uri == other.uri or self.uri.startswith(other.uri + "/")


# ---------------------------------------------------------------------------------------
# filesystems

_settings: StorageConfig | None = None
_cache: dict[tuple[str, str, int], Any] = {}


def configure(settings: StorageConfig | None) -> None:
    """The process's ``[storage]`` settings (None: environment only)."""
    global _settings
    _settings = settings


def _setting(settings: StorageConfig | None, name: str, *env: str) -> Any:
    v = getattr(settings, name, None) if settings is not None else None
    if v is None:
        v = next((os.environ[e] for e in env if os.environ.get(e)), None)
    return v


def s3_options(settings: StorageConfig | None) -> dict[str, Any]:
    """Keyword arguments of ``pyarrow.fs.S3FileSystem`` from the settings and environment."""
    kw: dict[str, Any] = {}
    endpoint = _setting(settings, "endpoint_url", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    if endpoint:
        kw["endpoint_override"] = endpoint
    region = _setting(settings, "region", "AWS_REGION", "AWS_DEFAULT_REGION")
    if region:
        kw["region"] = region
    if settings is not None and settings.anonymous:
        kw["anonymous"] = True
    if settings is not None:
        kw.update(settings.options)
    return kw


def retries(settings: StorageConfig | None) -> int:
    """Retries of one failed S3 request (``storage.retries``; its default without settings)."""
    if settings is None:
        from batchjob.storage.settings import StorageConfig

        settings = StorageConfig()
    return settings.retries


def filesystem(scheme: str, settings: StorageConfig | None = None) -> pafs.FileSystem:
    """The filesystem of ``scheme`` under ``settings`` (default: the configured ones).
    Raises ValueError (with the reason) for an unknown scheme or bad options.

    S3 retries each failed request (a network error, a 5xx, throttling) ``storage.retries``
    times with the AWS SDK's standard strategy (its backoff doubles from 25 ms), unless
    ``storage.options`` sets its own ``retry_strategy``. Every request pyarrow makes is one
    it may repeat: a GET, HEAD or LIST, a whole-object PUT, a multipart part."""
    settings = settings if settings is not None else _settings
    opts = s3_options(settings)
    key = (scheme, json.dumps(opts, sort_keys=True, default=str), retries(settings))
    if key in _cache:
        return _cache[key]
    import pyarrow.fs as pafs

    options = dict(settings.options) if settings is not None else {}
    if scheme in _S3_SCHEMES:
        if "retry_strategy" not in opts:
            # pyarrow's max_attempts counts the first try (3: two retries)
            opts["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(retries(settings) + 1)
        try:
            fs: pafs.FileSystem = pafs.S3FileSystem(**opts)
        except (TypeError, ValueError) as e:
            raise ValueError(f"pyarrow.fs.S3FileSystem refused the options: {e}") from None
    else:
        try:
            fs = pafs.FileSystem.from_uri(f"{scheme}://")[0] if not options else None
        except Exception:  # pyarrow does not know the scheme: fsspec may
            fs = None
        if fs is None:
            fs = _fsspec(scheme, options)
    _cache[key] = fs
    return fs


def _fsspec(scheme: str, options: dict[str, Any] | None = None) -> pafs.FileSystem:
    import pyarrow.fs as pafs

    try:
        import fsspec
    except ImportError:
        raise ValueError(
            f"no filesystem for {scheme}:// (pyarrow has none; install fsspec)"
        ) from None
    try:
        fs = fsspec.filesystem(scheme, **(options or {}))
    except (ImportError, ValueError, TypeError) as e:
        raise ValueError(f"no usable filesystem for {scheme}:// ({e})") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def check_uri(uri: str, settings: StorageConfig) -> None:
    """Load-time check: a filesystem exists for ``uri`` under ``settings`` (no network)."""
    filesystem(ObjectPath(uri).scheme, settings)


def arrow_source(path: str) -> tuple[str, pafs.FileSystem | None]:
    """What pyarrow's readers take: ``(path, None)`` locally, ``(bucket/key, fs)`` for a URI."""
    if not is_uri(path):
        return path, None
    p = ObjectPath(path)
    return p.key, filesystem(p.scheme)


def file_stat(path: str) -> tuple[int, int]:
    """(size, mtime in ns) of a local file or an object."""
    if not is_uri(path):
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns
    key, fs = arrow_source(path)
    assert fs is not None
    info = fs.get_file_info(key)
    return int(info.size or 0), int(info.mtime_ns or 0)


def list_files(uri: str) -> list[str]:
    """Every file below a URI folder, or the files matching a URI glob (``*``, ``?``, ``[``:
    ``*`` crosses ``/``); a file URI is itself. URIs, sorted; hidden names are the caller's."""
    import pyarrow.fs as pafs

    p = ObjectPath(uri)
    fs = filesystem(p.scheme)
    info = fs.get_file_info(p.key)
    if info.type == pafs.FileType.File:
        return [p.uri]
    if info.type == pafs.FileType.Directory:
        sel = pafs.FileSelector(p.key, recursive=True, allow_not_found=True)
        return sorted(
            f"{p.scheme}://{i.path.lstrip('/')}" for i in fs.get_file_info(sel) if i.is_file
        )
    parts = p.key.split("/")
    fixed = next((i for i, s in enumerate(parts) if any(c in s for c in "*?[")), len(parts))
    if fixed == len(parts) or fixed == 0:
        return []
    sel = pafs.FileSelector("/".join(parts[:fixed]), recursive=True, allow_not_found=True)
    out = []
    for i in fs.get_file_info(sel):
        if not i.is_file:
            continue
        head = i.path.lstrip("/").split("/")  # fsspec paths may start with "/"
        # the file itself matches, or it lies below a matching folder
        if any(
            fnmatch.fnmatchcase("/".join(head[:n]), p.key) for n in range(fixed + 1, len(head) + 1)
        ):
            out.append(f"{p.scheme}://{'/'.join(head)}")
    return sorted(out)


def _s3_client() -> Any:
    """A boto3 S3 client under the configured settings, or None without boto3."""
    try:
        import boto3
        import botocore.config
    except ImportError:
        return None
    kw = s3_options(_settings)
    opts = {"access_key": "aws_access_key_id", "secret_key": "aws_secret_access_key"}
    opts["session_token"] = "aws_session_token"
    client_kw = {opts[k]: v for k, v in kw.items() if k in opts}
    # botocore's standard mode: max_attempts counts the first try; backoff doubles, jittered
    retry = {"max_attempts": retries(_settings) + 1, "mode": "standard"}
    config = botocore.config.Config(retries=retry)
    if kw.get("anonymous"):
        config = config.merge(botocore.config.Config(signature_version=botocore.UNSIGNED))
    return boto3.client(
        "s3",
        endpoint_url=kw.get("endpoint_override"),
        region_name=kw.get("region"),
        config=config,
        **client_kw,
    )


_HASH_BLOCK = 4 << 20


def content_id(path: str) -> str:
    """What identifies the bytes of a local file or an object: ``sha256:<hex>`` of every byte
    (streamed; ~1.4 GB/s on one core with SHA-NI), or on S3 ``etag:<etag>`` when boto3 is
    there (the server's content tag: it changes whenever the object is written with other
    bytes; no download). ``OSError`` when it cannot be read."""
    import hashlib

    if not is_uri(path):
        with open(path, "rb") as f:
            return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    p = ObjectPath(path)
    if p.scheme in _S3_SCHEMES and (client := _s3_client()) is not None:
        import botocore.exceptions

        try:
            head = client.head_object(Bucket=p.bucket, Key=p.key.partition("/")[2])
        except botocore.exceptions.ClientError as e:
            raise OSError(f"{path}: cannot read the object's metadata: {e}") from None
        if head.get("ETag"):
            return f"etag:{head['ETag'].strip(chr(34))}"
    h = hashlib.sha256()
    with filesystem(p.scheme).open_input_stream(p.key) as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return "sha256:" + h.hexdigest()


def _ours(p: ObjectPath, data: bytes) -> bool:
    """A conditional write refused after a retry may have been refused because its own first
    try got through (the reply was lost): the object then holds exactly ``data``, which holds
    a token of the writer's own."""
    try:
        got = read_versioned(p)
    except OSError:
        return False
    return got is not None and got[0] == data


def put_if_absent(p: ObjectPath, data: bytes) -> bool | None:
    """Create object ``p`` only if it does not exist (S3 ``If-None-Match: *``): True created,
    False it exists, None no conditional put here (not S3, no boto3, or the server has none).
    Retried as every request is (``storage.retries``): a refusal of a retry that finds
    ``data`` there is this call's own write."""
    if p.scheme not in _S3_SCHEMES:
        return None
    client = _s3_client()
    if client is None:
        return None
    import botocore.exceptions

    try:
        client.put_object(Bucket=p.bucket, Key=p.key.partition("/")[2], Body=data, IfNoneMatch="*")
    except botocore.exceptions.ClientError as e:
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = e.response.get("Error", {}).get("Code")
        if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
            return _ours(p, data)
        if status == 501 or code == "NotImplemented":
            return None
        raise OSError(f"{p}: cannot create the lock object: {e}") from None
    return True


def read_versioned(p: ObjectPath) -> tuple[bytes, str] | None:
    """The bytes of S3 object ``p`` and the ETag of those very bytes (one GET), for a later
    conditional write (``put_if_match``); None: no such object, not S3, or no boto3."""
    if p.scheme not in _S3_SCHEMES or (client := _s3_client()) is None:
        return None
    import botocore.exceptions

    try:
        got = client.get_object(Bucket=p.bucket, Key=p.key.partition("/")[2])
        return got["Body"].read(), str(got["ETag"])
    except botocore.exceptions.ClientError as e:
        if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
            return None
        raise OSError(f"{p}: cannot read the lock object: {e}") from None


def put_if_match(p: ObjectPath, data: bytes, etag: str) -> bool | None:
    """Overwrite S3 object ``p`` only while it still holds the version ``etag`` names
    (``If-Match``; else, where the server has no conditional overwrite, delete it with
    ``If-Match`` and create it with ``If-None-Match: *``): True written, False the object
    changed or went away meanwhile, None no conditional write here."""
    if p.scheme not in _S3_SCHEMES or (client := _s3_client()) is None:
        return None
    import botocore.exceptions

    bucket, key = p.bucket, p.key.partition("/")[2]

    def outcome(e: botocore.exceptions.ClientError) -> bool | None:
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = e.response.get("Error", {}).get("Code")
        if status in (404, 409, 412) or code in ("PreconditionFailed", "NoSuchKey"):
            return False
        if status == 501 or code == "NotImplemented":
            return None
        raise OSError(f"{p}: cannot take over the lock object: {e}") from None

    try:
        client.put_object(Bucket=bucket, Key=key, Body=data, IfMatch=etag)
        return True
    except botocore.exceptions.ClientError as e:
        if (done := outcome(e)) is not None:
            return done or _ours(p, data)
    try:  # no conditional overwrite: a conditional delete, then a conditional create
        client.delete_object(Bucket=bucket, Key=key, IfMatch=etag)
    except botocore.exceptions.ClientError as e:
        if (done := outcome(e)) is not None:
            return done
        return None
    return put_if_absent(p, data)


# ---------------------------------------------------------------------------------------
# stores: the write path's operations on each kind of path


class LocalStore:
    """Local files, written atomically (``batchjob.storage.atomic``): the behaviour of before."""

    remote = False

    def exists(self, p: Path) -> bool:
        return p.exists()

    def is_file(self, p: Path) -> bool:
        return p.is_file()

    def is_dir(self, p: Path) -> bool:
        return p.is_dir()

    def glob(self, folder: Path, pattern: str) -> list[Path]:
        return sorted(folder.glob(pattern))

    def names(self, folder: Path) -> list[str]:
        """Every entry of ``folder`` (files, folders, links), sorted; [] when it is absent."""
        try:
            return sorted(os.listdir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def mkdir(self, p: Path) -> None:
        p.mkdir(parents=True, exist_ok=True)

    def read_text(self, p: Path) -> str:
        return p.read_text()

    def read_parquet(self, p: Path, **kwargs: Any) -> pa.Table:
        import pyarrow.parquet as pq

        return pq.read_table(p, **kwargs)

    def delete(self, p: Path) -> None:
        p.unlink(missing_ok=True)

    def delete_tree(self, p: Path) -> None:
        shutil.rmtree(p, ignore_errors=True)


class ObjectStore:
    """Objects through pyarrow.fs: a write is one PUT (atomic per object), no rename."""

    remote = True

    def __init__(self, scheme: str):
        self.fs = filesystem(scheme)

    def _info(self, p: ObjectPath) -> Any:
        return self.fs.get_file_info(p.key)

    def exists(self, p: ObjectPath) -> bool:
        import pyarrow.fs as pafs

        return bool(self._info(p).type != pafs.FileType.NotFound)

    def is_file(self, p: ObjectPath) -> bool:
        return bool(self._info(p).is_file)

    def is_dir(self, p: ObjectPath) -> bool:
        import pyarrow.fs as pafs

        return bool(self._info(p).type == pafs.FileType.Directory)

    def glob(self, folder: ObjectPath, pattern: str) -> list[ObjectPath]:
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(folder.key, recursive=False, allow_not_found=True)
        names = [posixpath.basename(i.path) for i in self.fs.get_file_info(sel) if i.is_file]
        return [folder / n for n in sorted(names) if fnmatch.fnmatchcase(n, pattern)]

    def names(self, folder: ObjectPath) -> list[str]:
        """Every object and sub-prefix directly below ``folder``, sorted."""
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(folder.key, recursive=False, allow_not_found=True)
        return sorted(posixpath.basename(i.path.rstrip("/")) for i in self.fs.get_file_info(sel))

    def mkdir(self, p: ObjectPath) -> None:
        pass  # prefixes exist when objects do

    def read_text(self, p: ObjectPath) -> str:
        with self.fs.open_input_stream(p.key) as f:
            return bytes(f.read()).decode()

    def read_parquet(self, p: ObjectPath, **kwargs: Any) -> pa.Table:
        import pyarrow.parquet as pq

        return pq.read_table(p.key, filesystem=self.fs, **kwargs)

    def write_bytes(self, p: ObjectPath, data: bytes) -> None:
        with self.fs.open_output_stream(p.key) as f:
            f.write(data)

    def delete(self, p: ObjectPath) -> None:
        if self.is_file(p):
            self.fs.delete_file(p.key)

    def delete_tree(self, p: ObjectPath) -> None:
        if self.exists(p):
            self.fs.delete_dir(p.key)


Store = LocalStore | ObjectStore


def store_for(p: Path | ObjectPath) -> Any:
    """The store of ``p`` (typed Any: each store takes its own kind of path)."""
    return ObjectStore(p.scheme) if isinstance(p, ObjectPath) else LocalStore()
