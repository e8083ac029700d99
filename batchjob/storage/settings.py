"""``[storage]``: object-store access for URI paths (``s3://bucket/prefix``). Declared here,
beside the code that uses it, so that storage imports nothing from ``batchjob.config``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from batchjob.errors import ConfigError


def _fail(key: str, msg: str, value: Any) -> None:
    raise ConfigError(f"{key}: {msg}, got {value!r}")


MAX_RETRIES = 20  # each wait is at most 20 s (the AWS SDKs), so ~6 minutes in all at most


def _int(key: str, v: Any, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        _fail(key, "must be an integer", v)
    if not lo <= v <= hi:
        _fail(key, f"must be in [{lo}, {hi}]", v)


@dataclass(frozen=True)
class StorageConfig:
    """Object-store access for URI paths (``s3://bucket/prefix``; batchjob.storage.stores). Unset
    values come from the environment: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_REGION /
    AWS_DEFAULT_REGION; credentials always from the AWS chain (AWS_ACCESS_KEY_ID, ...)."""

    endpoint_url: str | None = None  # an S3-compatible server; unset: AWS_ENDPOINT_URL(_S3)
    region: str | None = None  # the bucket's region; unset: AWS_REGION, AWS_DEFAULT_REGION
    anonymous: bool = False  # unsigned requests (public buckets)
    # retries of a failed S3 request (network error, 5xx, throttling); waits double, up to 20 s
    retries: int = 10
    options: dict[str, Any] = field(default_factory=dict)  # more pyarrow.fs.S3FileSystem args

    def __post_init__(self) -> None:
        for key in ("endpoint_url", "region"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v):
                _fail(f"storage.{key}", "must be a non-empty string", v)
        if self.endpoint_url is not None and not re.match(r"https?://", self.endpoint_url):
            _fail("storage.endpoint_url", "must start with http:// or https://", self.endpoint_url)
        if not isinstance(self.anonymous, bool):
            _fail("storage.anonymous", "must be true or false", self.anonymous)
        _int("storage.retries", self.retries, lo=0, hi=MAX_RETRIES)
        if not isinstance(self.options, dict):
            _fail("storage.options", "must be a table of S3FileSystem arguments", self.options)
