"""The reference of every job-file key, read from the sections themselves: each field's type
and default from its dataclass, what values it allows from the checks in its ``__post_init__``
(the choices of ``_str``, the bounds of ``_int`` and ``_float``), and its meaning from the
field's trailing comment; the per-row settings' bounds and ``input.*_column`` meanings come
from their table (``batchjob.config.per_row.ROW_SETTINGS``). ``batchjob keys [SECTION]``
prints it; docs/job_file.md holds the same tables between ``<!-- keys:SECTION -->`` markers
(a test regenerates and compares them, and fails for a field without its meaning).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Any

from batchjob.config.checks import INT64_MAX
from batchjob.config.job import SECTIONS
from batchjob.config.per_row import ROW_SETTINGS
from batchjob.config.sections import InputConfig, SamplingConfig


@dataclass(frozen=True)
class Key:
    section: str
    name: str
    type: str  # as a job file writes it: "integer", "text", "path", "list of text", ...
    default: str  # as a job file writes it ("128", "\"auto\"", "[]"), or "required", "unset"
    allowed: str  # "one of a, b", ">= 1", "(0.0, 1.0]", or "" (any value of the type)
    meaning: str  # the field's trailing comment ("" when it has none: a test refuses that)

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


_TYPES = {
    "str": "text",
    "int": "integer",
    "float": "number",
    "bool": "true or false",
    "Path": "path",
    "Path | ObjectPath": "path or URI",
    "tuple[int, ...]": "list of integers",
    "tuple[str, ...]": "list of text",
    "dict[str, Any]": "table",
    "dict[int, float]": "table of token id = number",
    "dict[str, Path]": "table of name = folder",
}


def _type_name(name: str, annotation: str, bytes_key: bool) -> str:
    if bytes_key:
        return 'bytes (an integer or "2GiB")'
    if name == "path" and annotation == "str":
        return "path, glob or URI"
    base = annotation.removesuffix(" | None")
    return _TYPES.get(base, base)


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value: Any = f.default_factory()
    elif f.default is dataclasses.MISSING:
        return "required"
    else:
        value = f.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


def _class_tree(cls: type) -> tuple[ast.ClassDef, dict[int, str], set[int]]:
    """The class's syntax tree, its comments by line (lines of the class source), and the
    lines that hold nothing but a comment."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    alone: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if tok.line.strip().startswith("#"):
                alone.add(tok.start[0])
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    return node, comments, alone


def _meanings(node: ast.ClassDef, comments: dict[int, str], alone: set[int]) -> dict[str, str]:
    """Each field's comment: the one trailing its declaration, else the comment lines right
    above it, joined."""
    out: dict[str, str] = {}
    for n in node.body:
        if not (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)):
            continue
        text = comments.get(n.end_lineno or n.lineno, "")
        line = n.lineno - 1
        above: list[str] = []
        while not text and line in alone:
            above.insert(0, comments[line])
            line -= 1
        out[n.target.id] = text or " ".join(above)
    return out


def _value(node: ast.expr, module: Any) -> Any:
    """A literal, or a module-level name (``BACKENDS``), from a check's arguments."""
    if isinstance(node, ast.Name):
        return getattr(module, node.id, None)
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _checks(node: ast.ClassDef, module: Any) -> tuple[dict[str, str], set[str]]:
    """-> ({dotted key: allowed values}, dotted keys parsed as byte sizes), from the calls
    of ``__post_init__``: ``_str(key, v, CHOICES)``, ``_int(key, v, lo=, hi=)``,
    ``_float(obj, name, key, lo, hi, lo_open=)``, ``parse_bytes(self.name)``."""
    allowed: dict[str, str] = {}
    byte_keys: set[str] = set()
    section = next(s for s, c in SECTIONS.items() if c.__name__ == node.name)
    for call in ast.walk(node):
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            continue
        fn, args = call.func.id, call.args
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        key_arg = args[2] if fn == "_float" and len(args) > 2 else args[0] if args else None
        if fn == "parse_bytes" and args and isinstance(args[0], ast.Attribute):
            byte_keys.add(f"{section}.{args[0].attr}")
            continue
        if not (isinstance(key_arg, ast.Constant) and isinstance(key_arg.value, str)):
            continue
        key = key_arg.value
        if fn == "_str" and len(args) > 2:
            choices = _value(args[2], module)
            if choices:
                allowed[key] = "one of " + ", ".join(choices)
        elif fn == "_int":
            lo = _value(kw["lo"], module) if "lo" in kw else None
            hi = _value(kw["hi"], module) if "hi" in kw else None
            if lo is not None:
                allowed[key] = _int_range(lo, hi)
        elif fn == "_float" and len(args) >= 5:
            lo, hi = _value(args[3], module), _value(args[4], module)
            lo_open = "lo_open" in kw and _value(kw["lo_open"], module)
            allowed[key] = _float_range(lo, hi, bool(lo_open))
    return allowed, byte_keys


def _int_range(lo: int, hi: int | None) -> str:
    return f">= {lo}" if hi is None or hi == INT64_MAX else f"{lo} to {hi}"


def _float_range(lo: float, hi: float, lo_open: bool) -> str:
    if hi >= 1e6:  # a sanity bound, not a range: the lower bound is what matters
        return f"{'>' if lo_open else '>='} {lo:g}"
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"


def _row_settings() -> tuple[dict[str, str], dict[str, str]]:
    """({dotted key: allowed values}, {dotted key: meaning}) from ``ROW_SETTINGS``: the bounds
    of the [sampling] keys that ``SamplingConfig`` checks from the table, and the meaning of
    each ``input.<name>_column``."""
    allowed: dict[str, str] = {}
    for s in ROW_SETTINGS:
        if s.lo is None or s.hi is None:
            continue
        if s.kind == "integer":
            allowed[s.key] = _int_range(int(s.lo), int(s.hi))
        else:
            allowed[s.key] = _float_range(s.lo, s.hi, s.lo_open)
    return allowed, {f"input.{s.column}": s.meaning() for s in ROW_SETTINGS}


def keys(section: str | None = None) -> list[Key]:
    """Every key of ``section`` (all sections: None), in declaration order."""
    out: list[Key] = []
    for name, cls in SECTIONS.items():
        if section is not None and name != section:
            continue
        node, comments, alone = _class_tree(cls)
        meanings = _meanings(node, comments, alone)
        allowed, byte_keys = _checks(node, sys.modules[cls.__module__])
        if cls in (InputConfig, SamplingConfig):  # the per-row settings: from their table
            row_allowed, row_meanings = _row_settings()
            allowed |= {k: v for k, v in row_allowed.items() if k.startswith(f"{name}.")}
            meanings |= {
                k.removeprefix(f"{name}."): v
                for k, v in row_meanings.items()
                if k.startswith(f"{name}.")
            }
        for f in dataclasses.fields(cls):
            dotted = f"{name}.{f.name}"
            out.append(
                Key(
                    section=name,
                    name=f.name,
                    type=_type_name(f.name, str(f.type), dotted in byte_keys),
                    default=_default(f),
                    allowed=allowed.get(dotted, ""),
                    meaning=meanings.get(f.name, ""),
                )
            )
    return out


def format_text(section: str | None = None) -> str:
    """``batchjob keys``: one entry per key, ``section.key = default  (type, allowed)`` and
    its meaning on the next line."""
    lines: list[str] = []
    for k in keys(section):
        kind = f"{k.type}, {k.allowed}" if k.allowed else k.type
        lines += [f"{k.dotted} = {k.default}  ({kind})", f"    {k.meaning}"]
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Markdown table cell text: ``|`` and ``<`` escaped (``list<int>`` is not a tag)."""
    return text.replace("|", "\\|").replace("<", "\\<")


def format_markdown(section: str) -> str:
    """One section's keys as the Markdown table docs/job_file.md holds."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for k in keys(section):
        kind = f"{k.type}, {k.allowed}" if k.allowed else k.type
        default = k.default if k.default in ("required", "unset") else f"`{k.default}`"
        rows.append(f"| `{k.name}` | {_cell(kind)} | {default} | {_cell(k.meaning)} |")
    return "\n".join(rows)


def marker(section: str) -> tuple[str, str]:
    """The lines that enclose ``section``'s generated table in docs/job_file.md."""
    return f"<!-- keys:{section} (generated by `batchjob keys --markdown`) -->", "<!-- /keys -->"


def markdown_blocks() -> str:
    """Every section's table between its markers (what ``batchjob keys --markdown`` prints)."""
    parts = []
    for s in SECTIONS:
        start, end = marker(s)
        parts.append(f"{start}\n{format_markdown(s)}\n{end}")
    return "\n\n".join(parts)


def sync_markdown(text: str) -> str:
    """``text`` (docs/job_file.md) with every generated table regenerated; a section whose
    markers are missing is left out (the test of the docs names it)."""
    for s in SECTIONS:
        start, end = marker(s)
        i = text.find(start)
        j = text.find(end, i)
        if i >= 0 and j >= 0:
            text = f"{text[:i]}{start}\n{format_markdown(s)}\n{text[j:]}"
    return text
