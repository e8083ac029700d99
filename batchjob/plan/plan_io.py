"""Plan <-> Parquet: one row per member, in execution order; PlanStats in the schema metadata.

Columns: group (int64, index in execution order), row_id (int64), position (int64: prompt
position in the TokenizedPrompts the plan was built from), prefix_len (int64, the group's),
decode_estimate (int32). Written atomically (batchjob.storage.atomic).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.errors import InputDataError
from batchjob.plan.plan import Plan, PlanStats
from batchjob.storage.atomic import Target, write_parquet_atomic

_META_KEY = b"batchjob.plan_stats"
_VERSION_KEY = b"batchjob.plan_version"
_VERSION = b"1"
_COLUMNS = ("group", "row_id", "position", "prefix_len", "decode_estimate")


def plan_schema(stats: PlanStats) -> pa.Schema:
    """The plan file's columns, with ``stats`` in its metadata (a streamed plan's writer
    opens with it: the stats are known before the first group is written)."""
    meta = {_META_KEY: json.dumps(asdict(stats)).encode(), _VERSION_KEY: _VERSION}
    types = (pa.int64(), pa.int64(), pa.int64(), pa.int64(), pa.int32())
    return pa.schema(list(zip(_COLUMNS, types, strict=True)), metadata=meta)


def plan_to_table(plan: Plan) -> pa.Table:
    sizes = np.diff(plan.group_offsets)
    cols = [
        np.repeat(np.arange(plan.num_groups, dtype=np.int64), sizes),
        plan.row_ids.astype(np.int64),
        plan.members.astype(np.int64),
        np.repeat(plan.group_prefix_len.astype(np.int64), sizes),
        plan.decode_estimate.astype(np.int32),
    ]
    return pa.Table.from_arrays([pa.array(c) for c in cols], schema=plan_schema(plan.stats))


def write_plan(plan: Plan, path: Target) -> None:
    """Write atomically: readers see the old file or the complete new one, never a part."""
    write_parquet_atomic(plan_to_table(plan), path)


def _bad(path: Path, why: str) -> InputDataError:
    return InputDataError(f"{path}: not a valid batchjob plan file: {why}")


def read_plan(path: str | os.PathLike) -> Plan:
    path = Path(path)
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise _bad(path, str(e)) from e
    meta = table.schema.metadata or {}
    missing = [c for c in _COLUMNS if c not in table.column_names]
    if _META_KEY not in meta or missing:
        raise _bad(path, f"missing columns {missing} or stats metadata")
    try:
        raw = json.loads(meta[_META_KEY])
        stats = PlanStats(**{f.name: raw[f.name] for f in fields(PlanStats)})
    except (ValueError, KeyError, TypeError) as e:
        raise _bad(path, f"unreadable stats metadata ({e!r})") from e
    col = {c: table.column(c).to_numpy() for c in _COLUMNS}
    group = col["group"].astype(np.int64)
    num_groups = int(group[-1]) + 1 if len(group) else 0
    steps = np.diff(group)
    if len(group) and (group[0] != 0 or np.any((steps != 0) & (steps != 1))):
        raise _bad(path, "column 'group' must count up from 0 in steps of 0 or 1")
    offsets = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(np.bincount(group, minlength=num_groups), out=offsets[1:])
    prefix = col["prefix_len"].astype(np.int64)
    if np.any(prefix != np.repeat(prefix[offsets[:-1]], np.diff(offsets))):
        raise _bad(path, "column 'prefix_len' differs within a group")
    return Plan(
        group_prefix_len=prefix[offsets[:-1]],
        group_offsets=offsets,
        members=col["position"].astype(np.int64),
        row_ids=col["row_id"].astype(np.int64),
        decode_estimate=col["decode_estimate"].astype(np.int32),
        stats=stats,
    )
