"""Per-row output constraints: ``input.json_schema_column`` (a JSON schema), ``regex_column``
(a regex) and ``choice_column`` (list<string>), each overriding the job's ``sampling.json_schema``
/ ``regex`` / ``choice`` for its row (null: the job's constraint, if any).

Each distinct value is checked (compiled by xgrammar) once; a value that does not compile, an
empty choice list, or a row that sets more than one of the three columns rejects that row
(``invalid_json_schema``, ``invalid_regex``, ``invalid_choice``). ``row_guides`` gives each
prompt position its ``Guide`` for the backends.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from batchjob.config import SamplingConfig
from batchjob.config.guided import Guide, check_choices, check_regex

# setting column -> the RowSettings field and the Guide kind it holds
GUIDE_FIELDS = {
    "json_schema_column": ("json_schema", "json"),
    "regex_column": ("regex", "regex"),
    "choice_column": ("choice", "choice"),
}


def _short(v: object) -> object:
    return v if not isinstance(v, str) or len(v) <= 80 else v[:77] + "..."


def read_guides(
    columns: dict[str, tuple[str, pa.Array]],
    m: int,
    reject: Callable[[int, str, str, str, object], None],
    vllm: bool,
) -> dict[str, tuple[str | None, ...]]:
    """The RowSettings fields of the configured constraint columns (``{setting column: (column
    name, values)}``, ``m`` rows); ``reject(i, setting column, column, what, value)`` for a bad
    row. ``vllm``: JSON schemas are also checked for the features vLLM refuses."""
    from batchjob.config.json_schema import compact_json_schema

    def check(name: str, value):
        if name == "json_schema_column":
            return compact_json_schema(value, vllm)
        if name == "regex_column":
            return check_regex(value)
        return check_choices(value)

    out: dict[str, tuple[str | None, ...]] = {}
    seen = [""] * m  # the column that set each row's constraint so far
    for name, (col, arr) in columns.items():
        done: dict[object, str | ValueError] = {}
        vals: list[str | None] = []
        for i, v in enumerate(arr.to_pylist()):
            if v is None:
                vals.append(None)
                continue
            key = tuple(v) if isinstance(v, list) else v
            c = done.get(key)
            if c is None:
                try:
                    c = done[key] = check(name, v)
                except ValueError as e:
                    c = done[key] = e
            if isinstance(c, ValueError):
                reject(i, name, col, str(c), _short(v))
                vals.append(None)
            elif seen[i]:
                other = f"input.{seen[i]}"
                reject(i, name, col, f"a row takes one constraint ({other} is set too)", _short(v))
                vals.append(None)
            else:
                seen[i] = name
                vals.append(c)
        out[GUIDE_FIELDS[name][0]] = tuple(vals)
    return out


def job_guide(sampling: SamplingConfig) -> Guide | None:
    """The job's constraint (``sampling.json_schema``, ``regex`` or ``choice``), if any."""
    if sampling.json_schema is not None:
        return Guide("json", sampling.json_schema)
    if sampling.regex is not None:
        return Guide("regex", sampling.regex)
    if sampling.choice:
        return Guide("choice", check_choices(sampling.choice))
    return None


def row_guides(sampling: SamplingConfig, prompts) -> list[Guide | None] | None:
    """The constraint of each prompt position (its row's own, else the job's); None when no
    row is constrained."""
    default = job_guide(sampling)
    rs = prompts.settings
    own = [
        (GUIDE_FIELDS[name][1], getattr(rs, GUIDE_FIELDS[name][0]))
        for name in GUIDE_FIELDS
        if rs is not None and getattr(rs, GUIDE_FIELDS[name][0]) is not None
    ]
    if not own:
        return None if default is None else [default] * len(prompts)
    out: list[Guide | None] = []
    for r in prompts.row_ids:
        i = rs.index(int(r))
        g = next((Guide(kind, vals[i]) for kind, vals in own if vals[i] is not None), default)
        out.append(g)
    return out if any(g is not None for g in out) else None
