"""Loading a job: the TOML file, then ``--set section.key=value`` overrides.

- Unknown sections or keys, wrong types and bad values raise ``ConfigError`` naming the
  dotted key and the file (``scheduler.chunk_size``, ``jobs/demo.toml``).
- Relative paths written in the TOML file resolve against the TOML file's directory; paths
  given on the command line (``--set input.path=...``, ``--input``) resolve against the
  current directory, as a shell user expects.
- ``--set section.key=value`` parses ``value`` as a TOML literal (``4096``, ``true``,
  ``[1, 2]``, ``"text"``) and falls back to the raw string (``2GiB``, ``data/x.parquet``).
  For text-valued keys the raw string is always used; ``none`` resets an optional key.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from batchjob.config.job import SECTIONS as _SECTIONS
from batchjob.config.job import JobConfig
from batchjob.errors import ConfigError
from batchjob.storage.stores import configure as configure_storage
from batchjob.storage.stores import is_uri

_PATH_KEYS = {
    "input.path",
    "model.path",
    "output.path",
    "output.report_path",
    "output.plan_path",
    "model.chat_template",  # "auto" and "none" are words, not paths (see _resolve)
}


def parse_assignments(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["a.b=1", "c.d=x=y"]`` -> ``{"a.b": "1", "c.d": "x=y"}`` (for repeated --set)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key.strip():
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        out[key.strip()] = value
    return out


def _field_type(section: str, key: str) -> str:
    for f in dataclasses.fields(_SECTIONS[section]):
        if f.name == key:
            return str(f.type)
    return ""


def _parse_value(dotted: str, raw: str) -> Any:
    section, _, key = dotted.partition(".")
    ftype = _field_type(section, key)
    if dotted == "model.chat_template" and raw.strip() in ("auto", "none"):
        return raw.strip()  # words of this key, not "unset"
    if raw.strip().lower() in ("none", "null") and "None" in ftype:
        return None
    if ftype.startswith(("str", "Path")) and not raw.strip().startswith(('"', "'")):
        return raw  # text keys take the raw string: --set input.id_column=2024
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _resolve(value: Any, base: Path) -> Any:
    if value is None or not isinstance(value, str | Path) or value in ("auto", "none"):
        return value
    if is_uri(value):
        return str(value)  # s3://bucket/key: not a local path
    if str(value).startswith("file://"):
        value = str(value)[len("file://") :]
    p = Path(value).expanduser()
    return os.path.normpath(p if p.is_absolute() else base / p)  # globs survive normpath


def _check_keys(raw: dict[str, Any], where: str) -> None:
    for section, table in raw.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"{where}: unknown section [{section}] (expected one of {', '.join(_SECTIONS)})"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{section}] must be a table")
        names = {f.name for f in dataclasses.fields(_SECTIONS[section])}
        for key in table:
            if section == "model" and key == "trust_remote_code":
                raise ConfigError(f"model.trust_remote_code: not supported ({where})")
            if key not in names:
                raise ConfigError(
                    f"{section}.{key}: unknown key in {where} (known: {', '.join(sorted(names))})"
                )


def load_job(
    path: str | Path | None,
    overrides: dict[str, str] | None = None,
    *,
    cwd: Path | None = None,
) -> JobConfig:
    """Load a job file and apply ``{"section.key": "value"}`` overrides (strings, as typed).

    ``path`` may be None to build a job from overrides alone.
    """
    cwd = cwd or Path.cwd()
    raw: dict[str, dict[str, Any]] = {}
    where = "command line"
    source = None
    if path is not None:
        source = Path(path).expanduser().resolve()
        where = str(path)
        try:
            raw = tomllib.loads(source.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{where}: job file not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{where}: cannot read job file: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{where}: invalid TOML: {e}") from None
        _check_keys(raw, where)
        for dotted in _PATH_KEYS:
            section, _, key = dotted.partition(".")
            if key in raw.get(section, {}):
                raw[section][key] = _resolve(raw[section][key], source.parent)
        schema = raw.get("sampling", {}).get("json_schema")
        if isinstance(schema, str) and not schema.lstrip().startswith("{"):
            raw["sampling"]["json_schema"] = _resolve(schema, source.parent)  # a file path

    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        _check_keys({section: {key: None}}, f"--set {dotted}")
        parsed = _parse_value(dotted, value)
        raw.setdefault(section, {})[key] = _resolve(parsed, cwd) if dotted in _PATH_KEYS else parsed

    suffix = f" ({where})"
    try:
        for section in ("input", "output"):
            if "path" not in raw.get(section, {}):
                raise ConfigError(f"{section}.path: required")
        sections = {name: cls(**raw.get(name, {})) for name, cls in _SECTIONS.items()}
        job = JobConfig(**sections, source=source)
    except ConfigError as e:
        raise ConfigError(f"{e}{suffix}") from None
    configure_storage(job.storage)  # the process's object-store settings (batchjob.storage.stores)
    return job
