"""The per-row settings, declared once: ``ROW_SETTINGS``, one ``RowSetting`` each.

A per-row setting is a ``[sampling]`` key that a row can override through an input column
(``input.<name>_column``; a null value takes the job's). Each entry says what the column holds
(``kind``), the values it allows (``lo``, ``hi``, ``lo_open``: one set for both backends,
vLLM's ``SamplingParams`` ranges, so a job valid on one runs on the other; ``off``: vLLM's
value meaning "off" where batchjob's differs, taken as batchjob's), how the row's value
applies (``applies``), whether it is a logits processor or an OpenAI Batch request field, and
its meaning. Everything that lists
these settings derives from here: the checks of ``[sampling]`` (``SamplingConfig``), the
``input.*_column`` keys (their names, their reference lines in ``batchjob keys``), the checks
of a row's value and the status it gets when bad (``batchjob.inputs.row_settings``,
``batchjob.status.STATUS_INVALID_SETTING``), the logits processors a setting turns on.

``max_tokens`` is not here: its column (``input.max_tokens_column``, on by default) is read
with the prompts (``batchjob.tokenize``), not with these.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOKENS = 2**31 - 1  # per-row limits are int32 (a row's max_tokens column: the same bound)
MAX_SAMPLES = 2**16  # sampling.n and a row's n: a result is keyed by row_id * 2**16 + sample
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams and the OpenAI API refuse more; so do both backends
INT64_MAX = 2**63 - 1  # no integer setting is larger: numpy and Arrow hold them as int64

# what a setting's column holds -> (the Arrow type it needs, as a message says it; the
# reference's words for it)
KINDS = {
    "number": ("a number", "a number"),
    "integer": ("an integer", "an integer"),
    "text": ("string", "a string"),
    "strings": ("list<string>", "list<string>"),
    "token_ids": ("list<integer>", "list<integer>"),
    "token_bias": ("map<integer, number>", "map<integer, number>"),
}
# how a row's value applies: "sampling" replaces the [sampling] key of that name for the row
# (RowSettings.apply), "guide" constrains the output (batchjob.inputs.row_guides), "labels"
# scores them, "samples" sets the row's number of samples
APPLIES = ("sampling", "guide", "labels", "samples")


@dataclass(frozen=True)
class RowSetting:
    name: str  # the [sampling] key, and the RowSettings field of the row's values
    kind: str  # what the column holds: one of KINDS
    doc: str  # what the column sets, for the key reference ("per-row <doc>, <kind>")
    applies: str = "sampling"  # one of APPLIES
    lo: float | None = None  # number / integer: the lowest value allowed
    hi: float | None = None  # ... the highest (INT64_MAX: no upper bound)
    lo_open: bool = False  # the lowest value itself is refused
    off: int | None = None  # vLLM's "off" value (top_k = -1), taken as the default (0)
    invalid: str | None = None  # a row's bad value: this message instead of the range's
    processor: bool = False  # a logits processor (off for scoring; SamplingConfig.processors)
    request: bool = False  # an OpenAI Batch request's body field (batchjob.inputs.openai_batch)

    def __post_init__(self) -> None:
        assert self.kind in KINDS and self.applies in APPLIES, self

    @property
    def column(self) -> str:
        """The ``[input]`` key naming the setting's column: ``temperature_column``."""
        return f"{self.name}_column"

    @property
    def key(self) -> str:
        """The dotted ``[sampling]`` key: ``sampling.temperature``."""
        return f"sampling.{self.name}"

    @property
    def status(self) -> str:
        """The status of a row whose value the setting refuses: ``invalid_temperature``."""
        return f"invalid_{self.name}"

    @property
    def column_type(self) -> str:
        """The column type it needs, as an error message names it."""
        return KINDS[self.kind][0]

    def allowed(self) -> str:
        """What a bad row value's message says it must be: ``must be in [0, 2]``."""
        if self.invalid is not None:
            return self.invalid
        assert self.lo is not None and self.hi is not None, self.name
        if self.kind == "integer":
            hi, off = int(self.hi), "" if self.off is None else f" (or {self.off}: off)"
            if hi == INT64_MAX:
                return f"must be >= {self.lo}{off}"
            return f"must be in [{self.lo}, {hi}]{off}"
        return f"must be in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"

    def bounds(self) -> tuple[float, float]:
        """(lo, hi) of a number or integer setting (``off`` included), on both backends."""
        assert self.lo is not None and self.hi is not None, self.name
        return (self.lo if self.off is None else min(self.lo, self.off)), self.hi

    def range(self) -> str:
        """The values a number or integer setting allows, as the reference says them:
        ``[0, 100]``, ``(0, 1]``, ``> 0``, ``>= 0``; "" for the other kinds."""
        if self.lo is None or self.hi is None:
            return ""
        if self.kind == "integer":
            if int(self.hi) == INT64_MAX:
                return f">= {self.lo}"
            return f"[{self.lo}, {int(self.hi)}]"
        if self.hi >= 1e6:  # a sanity bound, not a range: the lower bound is what matters
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"

    def meaning(self) -> str:
        """The reference line of ``input.<name>_column``."""
        text = f"per-row {self.doc}, {KINDS[self.kind][1]}"
        if r := self.range():
            text += f" {r}" if r.startswith(">") else f" in {r}"
        if self.off is not None:
            text += f" ({self.lo:g} or {self.off}: off)"
        return text


ROW_SETTINGS: tuple[RowSetting, ...] = (
    RowSetting("temperature", "number", "temperature", lo=0.0, hi=MAX_TEMPERATURE, request=True),
    RowSetting("top_p", "number", "top_p", lo=0.0, hi=1.0, lo_open=True, request=True),
    RowSetting("top_k", "integer", "top_k", lo=0, hi=INT64_MAX, off=-1, request=True),
    RowSetting("seed", "integer", "seed", lo=0, hi=INT64_MAX, request=True),
    RowSetting("stop", "strings", "stop strings", request=True),
    RowSetting("min_p", "number", "min_p", lo=0.0, hi=1.0, processor=True, request=True),
    RowSetting("presence_penalty", "number", "presence_penalty", lo=-2.0, hi=2.0,
               processor=True, request=True),
    RowSetting("frequency_penalty", "number", "frequency_penalty", lo=-2.0, hi=2.0,
               processor=True, request=True),
    RowSetting("repetition_penalty", "number", "repetition_penalty", lo=0.0, hi=1e9,
               lo_open=True, invalid="must be > 0 and finite", processor=True, request=True),
    RowSetting("min_tokens", "integer", "min_tokens", lo=0, hi=MAX_TOKENS, processor=True,
               request=True),
    RowSetting("logit_bias", "token_bias", "logit bias", processor=True, request=True),
    RowSetting("allowed_token_ids", "token_ids", "allowed token ids", processor=True),
    RowSetting("labels", "strings", "scoring labels", applies="labels"),
    RowSetting("json_schema", "text", "JSON schema (structured output)", applies="guide"),
    RowSetting("regex", "text", "regex the output must match", applies="guide"),
    RowSetting("choice", "strings", "choices the output must be one of", applies="guide"),
    RowSetting("n", "integer", "number of samples", applies="samples", lo=1, hi=MAX_SAMPLES,
               request=True),
)  # fmt: skip
BY_COLUMN: dict[str, RowSetting] = {s.column: s for s in ROW_SETTINGS}
BY_NAME: dict[str, RowSetting] = {s.name: s for s in ROW_SETTINGS}

# the [input] keys of the per-row columns, in declaration order (InputConfig declares them so)
ROW_SETTING_COLUMNS = tuple(s.column for s in ROW_SETTINGS)
GUIDE_COLUMNS = tuple(s.column for s in ROW_SETTINGS if s.applies == "guide")
PROCESSOR_COLUMNS = tuple(s.column for s in ROW_SETTINGS if s.processor)
# the [sampling] keys a row's value replaces (RowSettings.key order)
SAMPLING_FIELDS = tuple(s.name for s in ROW_SETTINGS if s.applies == "sampling")
# the per-row columns of an OpenAI Batch input (a .jsonl path): its requests' body fields,
# honoured without the job naming them (batchjob.inputs.openai_batch)
REQUEST_COLUMNS = {s.column: s.name for s in ROW_SETTINGS if s.request}
