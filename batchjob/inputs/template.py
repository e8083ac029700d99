"""``input.template``: each row's prompt built from its columns, vectorised with polars.

``"Article: {title}\\n\\n{context}\\n\\nQuestion: {question}\\nAnswer:"``: a placeholder
names a column (everything between the braces is the name); ``{{`` and ``}}`` are literal
braces. One ``pl.concat_str`` over the Arrow batch builds every prompt (Rust, no Python
loop per row). A row with a null in a named column gets no prompt: ``render`` says which
column, and the row is rejected with status ``null_field`` (its result row says so).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa


def parse_template(template: str) -> tuple[tuple[str, str | None], ...]:
    """-> ((literal, column or None), ...); ValueError on a lone brace or empty ``{}``."""
    parts: list[tuple[str, str | None]] = []
    lit: list[str] = []
    i, n = 0, len(template)
    while i < n:
        ch = template[i]
        if ch in "{}" and template[i : i + 2] == ch * 2:
            lit.append(ch)  # {{ or }}: a literal brace
            i += 2
        elif ch == "{":
            end = template.find("}", i + 1)
            inner = template[i + 1 : end] if end >= 0 else ""
            if end < 0 or "{" in inner:
                raise ValueError(f"unclosed '{{' at character {i} (write {{{{ for a brace)")
            if not inner.strip():
                raise ValueError(f"empty placeholder '{{}}' at character {i}; name a column")
            parts.append(("".join(lit), inner))
            lit = []
            i = end + 1
        elif ch == "}":
            raise ValueError(f"single '}}' at character {i} (write }}}} for a brace)")
        else:
            lit.append(ch)
            i += 1
    if lit or not parts:
        parts.append(("".join(lit), None))
    return tuple(parts)


def _is_scalar(t: pa.DataType) -> bool:
    """Types a placeholder can print: text, numbers, booleans, dates and times."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return not (
        pa.types.is_nested(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_null(t)
    )


@dataclass(frozen=True)
class PromptTemplate:
    """A parsed ``input.template``."""

    text: str
    parts: tuple[tuple[str, str | None], ...]  # (literal before, column) ... (tail, None)

    @classmethod
    def parse(cls, text: str) -> PromptTemplate:
        return cls(text, parse_template(text))

    @property
    def columns(self) -> tuple[str, ...]:
        """Column names in order of first use."""
        return tuple(dict.fromkeys(c for _, c in self.parts if c is not None))

    def check_schema(self, schema: pa.Schema) -> str | None:
        """None when every placeholder names a printable column, else what is wrong."""
        for c in self.columns:
            if c not in schema.names:
                return (
                    f"column {c!r} (named in input.template) not found; "
                    f"available columns: {', '.join(schema.names)}"
                )
            t = schema.field(c).type
            if not _is_scalar(t):
                return f"column {c!r} (named in input.template) has type {t}; cannot print it"
        return None

    def render(self, table: pa.Table) -> tuple[pa.Array, np.ndarray]:
        """-> (prompts large_string [B], null at a row with a null field; first null column
        per row: object [B], None where the row is complete)."""
        cols = self.columns
        n = table.num_rows
        if not cols:  # a constant prompt
            return pa.array([self.parts[0][0]] * n, pa.large_string()), np.full(n, None, object)
        df = pl.from_arrow(table.select(list(cols)), rechunk=False)
        assert isinstance(df, pl.DataFrame)
        exprs: list[pl.Expr] = []
        for lit, col in self.parts:
            if lit:
                exprs.append(pl.lit(lit, dtype=pl.String))
            if col is not None:
                exprs.append(pl.col(col).cast(pl.String))
        out = df.select(pl.concat_str(exprs, ignore_nulls=False).alias("p"))
        prompts = out.to_series().to_arrow(compat_level=pl.CompatLevel.oldest())
        if prompts.type != pa.large_string():
            prompts = prompts.cast(pa.large_string())
        null_col = np.full(n, None, dtype=object)
        if any(df.null_count().row(0)):
            first = df.select(
                pl.coalesce([pl.when(pl.col(c).is_null()).then(pl.lit(c)) for c in cols])
            ).to_series()
            null_col = np.asarray(first.to_list(), dtype=object)
        return prompts, null_col
