"""The checks every section's ``__post_init__`` uses: each raises ``ConfigError`` naming the
dotted key (``scheduler.chunk_size: must be >= 1, got 0``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from batchjob.errors import ConfigError
from batchjob.storage.stores import ObjectPath, is_uri

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """``2GiB`` -> 2147483648; ``1.5GB`` -> 1500000000; ints pass through."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = _SIZE_UNITS.get(m.group(2).lower())
        if unit is not None:
            num = m.group(1)
            return int(num) * unit if num.isdigit() else int(float(num) * unit)
    raise ValueError(f"expected a byte count like 2147483648 or '2GiB', got {value!r}")


# ---------------------------------------------------------------------------------------
# checks used by __post_init__: each raises ConfigError("section.key: ...")


def plain(value: Any) -> Any:
    """A numpy scalar or array as the Python value it holds, so a message says ``-1.0``, not
    ``np.float64(-1.0)``; anything else as is."""
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return value.tolist()
    return value


def _fail(key: str, msg: str, value: Any) -> None:
    raise ConfigError(f"{key}: {msg}, got {plain(value)!r}")


INT64_MAX = 2**63 - 1  # no integer setting is larger: numpy and Arrow hold them as int64


def _int(
    key: str, v: Any, lo: int | None = None, optional: bool = False, hi: int = INT64_MAX
) -> None:
    if v is None and optional:
        return
    if not isinstance(v, int) or isinstance(v, bool):
        _fail(key, "must be an integer", v)
    if lo is not None and v < lo:
        _fail(key, f"must be >= {lo}", v)
    if v > hi:
        _fail(key, f"must be <= {hi}", v)


def _float(obj: Any, name: str, key: str, lo: float, hi: float, lo_open: bool = False) -> None:
    v = getattr(obj, name)
    if not isinstance(v, int | float) or isinstance(v, bool):
        _fail(key, "must be a number", v)
    if not (lo < v <= hi if lo_open else lo <= v <= hi):
        _fail(key, f"must be in {'(' if lo_open else '['}{lo}, {hi}]", v)
    object.__setattr__(obj, name, float(v))  # TOML `1` -> 1.0


def _bool(key: str, v: Any) -> None:
    if not isinstance(v, bool):
        _fail(key, "must be true or false", v)


def _str(key: str, v: Any, choices: tuple[str, ...] = (), optional: bool = False) -> None:
    if v is None and optional:
        return
    if not isinstance(v, str) or not v:
        _fail(key, "must be a non-empty string", v)
    if choices and v not in choices:
        _fail(key, f"must be one of {', '.join(choices)}", v)


def _path(obj: Any, name: str, key: str, optional: bool, uri: bool = False) -> None:
    """A local Path, or with ``uri`` an object-store URI as ``ObjectPath`` (storage.stores)."""
    v = getattr(obj, name)
    if v is None:
        if not optional:
            raise ConfigError(f"{key}: required")
        return
    if not isinstance(v, str | Path | ObjectPath) or not str(v).strip():
        _fail(key, "must be a path", v)
    if is_uri(v) and not uri:
        _fail(key, "must be a local path (object-store URIs are for input.path, output.*)", v)
    object.__setattr__(obj, name, ObjectPath(str(v)) if is_uri(v) else Path(v))


def _list(obj: Any, name: str, key: str, item: type) -> None:
    v = getattr(obj, name)
    if not isinstance(v, list | tuple) or not all(
        isinstance(x, item) and not isinstance(x, bool) for x in v
    ):
        _fail(key, f"must be a list of {item.__name__}", v)
    object.__setattr__(obj, name, tuple(v))
