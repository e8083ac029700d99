"""Loading a job: the TOML file, then ``--set section.key=value`` overrides.

- Unknown sections or keys, wrong types and bad values raise ``ConfigError`` naming the
  dotted key and the file (``scheduler.chunk_size``, ``jobs/demo.toml``).
- Relative paths written in the TOML file resolve against the TOML file's directory; paths
  given on the command line (``--set input.path=...``, ``--input``) resolve against the
  current directory, as a shell user expects.
- ``--set section.key=value`` parses ``value`` as a TOML literal (``4096``, ``true``,
  ``[1, 2]``, ``"text"``) and falls back to the raw string (``2GiB``, ``data/x.parquet``).
  For text-valued keys the raw string is always used; ``none`` or ``null`` resets an optional
  key. ``--set engine.vllm.tensor_parallel_size=2`` sets one entry of a table-valued key.
- A misspelled or misplaced key's error names the closest known key (``closest_key``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchjob.config.job import SECTIONS as _SECTIONS
from batchjob.config.job import JobConfig
from batchjob.config.request_asks import requests_ask
from batchjob.config.vllm_values import is_engine_arg
from batchjob.errors import ConfigError
from batchjob.model.hf_config import read_generation_sampling_defaults
from batchjob.model.hub import is_hub_id
from batchjob.storage.stores import configure as configure_storage
from batchjob.storage.stores import is_uri

log = logging.getLogger(__name__)
# set on an InputConfig by batchjob.generate's settings: the code gave sampling.max_tokens but
# left input.max_tokens_column at its default (a "max_tokens" column then still sets each
# row's limit, and the run says so in one line: batchjob.tokenize.batched.load_prompts)
IMPLICIT_MAX_TOKENS_COLUMN = "_max_tokens_column_by_default"

_PATH_KEYS = {
    "input.path",
    "model.path",
    "model.tokenizer",
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
        return _toml_value(dotted, raw)
    except tomllib.TOMLDecodeError:
        return raw


def _toml_value(dotted: str, raw: str) -> Any:
    """``raw`` as one TOML value; text that parses as more (``3\n[evil]\nx=1``) is refused."""
    parsed = tomllib.loads(f"v = {raw}")
    if set(parsed) != {"v"}:
        raise ConfigError(f"--set {dotted}: {raw!r} is not one value (it holds more TOML)")
    return parsed["v"]


def _resolve_model(value: Any, base: Path) -> Any:
    """model.path / model.tokenizer: a path, except a Hub id (``org/name``) that names no
    local folder, kept as written (``ModelConfig`` finds it in the Hub cache)."""
    if isinstance(value, str) and is_hub_id(value) and not (base / value).exists():
        return value
    return _resolve(value, base)


def _resolve(value: Any, base: Path) -> Any:
    if value is None or not isinstance(value, str | Path) or value in ("auto", "none"):
        return value
    if isinstance(value, str) and not value.strip():
        return value  # names no path (not the current folder): the section refuses it
    if is_uri(value):
        return str(value)  # s3://bucket/key: not a local path
    if str(value).startswith("file://"):
        value = str(value)[len("file://") :]
    p = Path(value).expanduser()
    return os.path.normpath(p if p.is_absolute() else base / p)  # globs survive normpath


def _resolve_path(dotted: str, value: Any, base: Path) -> Any:
    model = dotted in ("model.path", "model.tokenizer")
    return _resolve_model(value, base) if model else _resolve(value, base)


def _keys(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(_SECTIONS[section])]


def closest_key(section: str, key: str) -> str | None:
    """The dotted key meant by a misspelled or misplaced ``section.key``: the closest key of
    that section, else a key of that name in another section, else the closest key of any
    section; None when nothing is close (``difflib``)."""
    if section in _SECTIONS and (near := difflib.get_close_matches(key, _keys(section), n=1)):
        return f"{section}.{near[0]}"
    owners = [s for s in _SECTIONS if key in _keys(s)]
    if owners:
        return f"{owners[0]}.{key}"
    every = {k: s for s in reversed(list(_SECTIONS)) for k in _keys(s)}  # first section wins
    near = difflib.get_close_matches(key, list(every), n=1)
    return f"{every[near[0]]}.{near[0]}" if near else None


def _check_keys(raw: dict[str, Any], where: str) -> None:
    for section, table in raw.items():
        if section not in _SECTIONS:
            near = difflib.get_close_matches(section, list(_SECTIONS), n=1)
            hint = f"; did you mean [{near[0]}]?" if near else ""
            if not near and (moved := closest_key("", section)) is not None:
                hint = f"; did you mean {moved}?"  # a key written outside its section
            if not near and is_engine_arg(section) and not (moved or "").endswith(section):
                hint = f"; a vLLM engine argument goes in engine.vllm.{section}"
            raise ConfigError(
                f"{where}: unknown section [{section}]{hint} "
                f"(expected one of {', '.join(_SECTIONS)})"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{section}] must be a table")
        names = _keys(section)
        for key in table:
            if section == "model" and key == "trust_remote_code":
                raise ConfigError(f"model.trust_remote_code: not supported ({where})")
            if key not in names:
                near_key = closest_key(section, key)
                hint = f"; did you mean {near_key}?" if near_key else ""
                if is_engine_arg(key) and not (near_key or "").endswith("." + key):
                    hint = f"; a vLLM engine argument goes in engine.vllm.{key}"
                raise ConfigError(
                    f"{section}.{key}: unknown key in {where}{hint} "
                    f"(known: {', '.join(sorted(names))})"
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
    return build_job(*read_tables(path, overrides, cwd=cwd))


def read_tables(
    path: str | Path | None,
    overrides: dict[str, str] | None = None,
    *,
    cwd: Path | None = None,
    tables: Mapping[str, Mapping[str, Any]] | None = None,
    where: str = "command line",
) -> tuple[dict[str, dict[str, Any]], Path | None, str]:
    """A job's sections as plain tables, keys checked and paths resolved, not yet validated:
    the file's, then ``tables`` (typed values, ``batchjob.generate``'s settings), then the
    ``--set`` overrides -> (tables, the file, where the settings came from)."""
    cwd = cwd or Path.cwd()
    raw: dict[str, dict[str, Any]] = {}
    source = None
    if path is not None:
        source = Path(path).expanduser().resolve()
        try:
            raw = tomllib.loads(source.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: job file not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read job file: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        _check_keys(raw, str(path))
        where = str(path) if tables is None else f"{path} and {where}"
        for dotted in _PATH_KEYS:
            section, _, key = dotted.partition(".")
            if key in raw.get(section, {}):
                raw[section][key] = _resolve_path(dotted, raw[section][key], source.parent)
        schema = raw.get("sampling", {}).get("json_schema")
        if isinstance(schema, str) and not schema.lstrip().startswith("{"):
            raw["sampling"]["json_schema"] = _resolve(schema, source.parent)  # a file path
        adapters = raw.get("model", {}).get("adapters")
        if isinstance(adapters, dict):  # name = folder: each folder a path
            raw["model"]["adapters"] = {k: _resolve(v, source.parent) for k, v in adapters.items()}

    for section, table in (tables or {}).items():
        _check_keys({section: dict(table)}, where)
        for key, value in table.items():
            dotted = f"{section}.{key}"
            resolved = _resolve_path(dotted, value, cwd) if dotted in _PATH_KEYS else value
            raw.setdefault(section, {})[key] = resolved

    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        key, _, sub = key.partition(".")  # engine.vllm.tensor_parallel_size: in a table key
        _check_keys({section: {key: None}}, f"--set {dotted}")
        if sub:
            _set_in_table(raw.setdefault(section, {}), section, key, sub, value)
            continue
        parsed = _parse_value(dotted, value)
        resolved = _resolve_path(dotted, parsed, cwd) if dotted in _PATH_KEYS else parsed
        raw.setdefault(section, {})[key] = resolved
    return raw, source, where


def _set_in_table(raw: dict[str, Any], section: str, key: str, sub: str, value: str) -> None:
    """``--set section.key.sub=value`` for a table-valued key (``engine.vllm``,
    ``storage.options``): the value a TOML literal, else the raw string."""
    if not _field_type(section, key).startswith("dict"):
        raise ConfigError(
            f"--set {section}.{key}.{sub}: {section}.{key} is not a table; "
            f"write --set {section}.{key}=VALUE"
        )
    table = raw.setdefault(key, {})
    names = sub.split(".")
    for name in names[:-1]:
        if not isinstance(table, dict):
            break
        table = table.setdefault(name, {})
    if not isinstance(table, dict) or not all(names):
        raise ConfigError(f"--set {section}.{key}.{sub}: not a key of a table")
    try:
        table[names[-1]] = _toml_value(f"{section}.{key}.{sub}", value)
    except tomllib.TOMLDecodeError:
        table[names[-1]] = value


def _checkpoint_sampling(raw: dict[str, dict[str, Any]], sections: dict[str, Any]) -> Any:
    """[sampling] with the model's generation_config.json defaults for the keys the job left
    unset (``model.generation_config = "auto"``, vLLM's behaviour); scoring and embedding
    jobs draw nothing and take none."""
    model, sampling = sections["model"], sections["sampling"]
    scoring = bool(sampling.labels or sections["input"].labels_column) or model.task == "embed"
    if model.generation_config != "auto" or model.path is None or scoring:
        return sampling
    defaults, path = read_generation_sampling_defaults(model.path)
    given = raw.get("sampling", {})
    unset = {k: v for k, v in defaults.items() if k not in given}
    if not unset:
        return sampling
    shown = ", ".join(f"{k} = {v!r}" for k, v in unset.items())
    log.warning(
        "sampling defaults from %s: %s (for keys the job leaves unset; "
        'model.generation_config = "none" ignores the file)',
        path,
        shown,
    )
    try:
        return _SECTIONS["sampling"](**{**given, **unset})
    except ConfigError as e:
        raise ConfigError(
            f'{e} (from {path}; model.generation_config = "none" ignores the file)'
        ) from None


def _request_needs(raw: dict[str, dict[str, Any]], sections: dict[str, Any]) -> None:
    """An OpenAI Batch file (a local .jsonl input) computes what its requests ask, as the
    Batch API does, without flags: ``sampling.logprobs`` = the most top log-probs a request
    asks (only those requests get them in their output lines), ``input.json_schema_column``
    where a request has a ``response_format`` (and xgrammar is installed). A key the job
    sets itself wins (then a request asking more is its line's invalid_request)."""
    inp = sections["input"]
    if not inp.path.endswith(".jsonl") or not os.path.isfile(inp.path):
        return
    asks = requests_ask(inp.path)
    given_sampling, given_input = raw.get("sampling", {}), raw.get("input", {})
    if asks.logprobs is not None and "logprobs" not in given_sampling:
        sections["sampling"] = dataclasses.replace(sections["sampling"], logprobs=asks.logprobs)
    xgrammar = importlib.util.find_spec("xgrammar") is not None  # else: invalid_request rows
    if asks.json_schema and "json_schema_column" not in given_input and xgrammar:
        sections["input"] = dataclasses.replace(inp, json_schema_column="json_schema")


def build_job(raw: dict[str, dict[str, Any]], source: Path | None, where: str) -> JobConfig:
    """The job of ``read_tables``' tables: every section built and checked; a ConfigError
    names the key and ``where``."""
    suffix = f" ({where})"
    try:
        for section in ("input", "output"):
            if "path" not in raw.get(section, {}):
                raise ConfigError(f"{section}.path: required")
        sections = {name: cls(**raw.get(name, {})) for name, cls in _SECTIONS.items()}
        sections["model"] = sections["model"].with_hub_snapshots()  # after every check
        sections["sampling"] = _checkpoint_sampling(raw, sections)
        _request_needs(raw, sections)
        job = JobConfig(**sections, source=source)
    except ConfigError as e:
        raise ConfigError(f"{e}{suffix}") from None
    configure_storage(job.storage)  # the process's object-store settings (batchjob.storage.stores)
    return job
