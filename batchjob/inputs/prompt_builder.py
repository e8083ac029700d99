"""Where a row's prompt text comes from, when it is not one finished text column.

- ``input.template``: built from columns (``batchjob.inputs.template``, polars, vectorised);
- ``input.messages_column``: a ``list<struct<role, content>>`` conversation, rendered with
  the model's chat template (``batchjob.inputs.chat_template``);
- a prompt (the text column or the template's output) as the user turn of a chat, with
  ``input.system_prompt`` before it, when ``model.chat_template`` is ``auto`` or a PATH, or
  a system prompt is given (unset ``chat_template``: plain prompts are used as they are);
  the system prompt goes before rows whose messages do not start with a system turn.

``PromptBuilder.build`` turns one Arrow batch into prompt text plus the rows it rejects
(``null_field``, ``chat_template_error``, or a reason the input reader attached to the row);
the tokenizer then treats the text as any text column (chat text without added BOS/EOS).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jinja2
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchjob.config import InputConfig, ModelConfig
from batchjob.errors import InputDataError
from batchjob.inputs.chat_template import ChatTemplate, load_chat_template, missing_template
from batchjob.inputs.template import PromptTemplate
from batchjob.status import STATUS_CHAT_TEMPLATE, STATUS_NULL_FIELD

ERROR_COLUMN = "_request_error"  # a reader's per-row rejection: "status\tmessage" or null


@dataclass(frozen=True)
class BuiltPrompts:
    """One batch's prompt text and its rejected rows (batch-local indices)."""

    prompts: pa.Array  # large_string [B]; null where rejected
    reject: np.ndarray  # int64 [R] batch-local indices
    status: tuple[str, ...]  # [R]
    message: tuple[str, ...]  # [R] without the row location (the caller adds it)


def _is_messages(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    s = t.value_type
    if not pa.types.is_struct(s):
        return False
    names = {s.field(i).name: s.field(i).type for i in range(s.num_fields)}
    text = (pa.string(), pa.large_string())
    return names.get("role") in text and names.get("content") in text


@dataclass(frozen=True)
class PromptBuilder:
    """How one dataset's rows become prompt text (see the module docstring)."""

    prompt_column: str
    template: PromptTemplate | None = None
    messages_col: str | None = None  # list<struct<role, content>> column
    system_text: str | None = None  # input.system_prompt
    wrap_prompts: bool = False  # a prompt becomes the user turn of a chat
    chat: ChatTemplate | None = None  # None: not loaded (open_dataset without the model)
    error_column: str | None = None  # a reader's per-row rejections (OpenAI JSONL)

    @property
    def add_special_tokens(self) -> bool:
        """Chat text holds its special tokens already (HF tokenizes it without adding)."""
        return not (self.messages_col is not None or self.wrap_prompts)

    @property
    def consumed(self) -> tuple[str, ...]:
        """Input columns that become the prompt and are not passed through."""
        cols = [self.messages_col or ("" if self.template else self.prompt_column)]
        return tuple(c for c in [*cols, self.error_column] if c)

    def check_schema(self, schema: pa.Schema, where: str) -> None:
        """InputDataError naming the file and the column when the batch cannot be built."""
        if self.template is not None:
            if (why := self.template.check_schema(schema)) is not None:
                raise InputDataError(f"{where}: {why}")
            return
        col = self.messages_col or self.prompt_column
        key = "input.messages_column" if self.messages_col else "input.prompt_column"
        if col not in schema.names:
            raise InputDataError(
                f"{where}: column {col!r} ({key}) not found; "
                f"available columns: {', '.join(schema.names)}"
            )
        t = schema.field(col).type
        if self.messages_col and not _is_messages(t):
            raise InputDataError(
                f"{where}: column {col!r} (input.messages_column) has type {t}; expected "
                "list<struct<role: string, content: string>>"
            )
        if not self.messages_col and not _text(t):
            raise InputDataError(
                f"{where}: column {col!r} has type {t}; a chat prompt must be text (string)"
            )

    def _chat(self) -> ChatTemplate:
        if self.chat is None:  # built for metadata only (open_dataset without the model)
            raise missing_template("(not given to open_dataset)")
        return self.chat

    def build(self, table: pa.Table) -> BuiltPrompts:
        n = table.num_rows
        status: list[str | None] = [None] * n
        message: list[str] = [""] * n
        if self.error_column is not None and self.error_column in table.column_names:
            for i, e in enumerate(table.column(self.error_column).to_pylist()):
                if e is not None:
                    status[i], _, message[i] = e.partition("\t")
        if self.messages_col is not None:
            conversations = table.column(self.messages_col).to_pylist()
            for i, conv in enumerate(conversations):
                if status[i] is None and not conv:
                    status[i] = STATUS_NULL_FIELD
                    message[i] = f"column {self.messages_col!r} is null or has no messages"
            texts: list[str | None] = self._render(conversations, status, message)
            prompts = pa.array(texts, pa.large_string())
        else:
            if self.template is not None:
                prompts, null_col = self.template.render(table)
                for i in np.flatnonzero(null_col != None):  # noqa: E711 (elementwise)
                    if status[i] is None:
                        status[i] = STATUS_NULL_FIELD
                        message[i] = f"column {null_col[i]!r} (in input.template) is null"
            else:
                prompts = table.column(self.prompt_column).combine_chunks()
                if pa.types.is_dictionary(prompts.type):
                    prompts = prompts.dictionary_decode()
            if self.wrap_prompts:
                turns = [
                    None if p is None else [{"role": "user", "content": p}]
                    for p in prompts.to_pylist()
                ]
                prompts = pa.array(self._render(turns, status, message), pa.large_string())
        reject = np.asarray([i for i in range(n) if status[i] is not None], dtype=np.int64)
        null = prompts.is_null().to_numpy(zero_copy_only=False)
        if len(reject) and not null[reject].all():  # (template nulls are null already)
            keep = np.ones(n, dtype=bool)
            keep[reject] = False
            prompts = pc.if_else(pa.array(keep), prompts, pa.nulls(n, prompts.type))
        return BuiltPrompts(
            prompts,
            reject,
            tuple(status[i] for i in reject),
            tuple(message[i] for i in reject),
        )

    def _render(self, conversations: list, status: list, message: list) -> list[str | None]:
        """Each conversation through the chat template (system prompt first); a row the
        template refuses gets ``chat_template_error``."""
        chat = self._chat() if any(c for c in conversations) else None
        out: list[str | None] = [None] * len(conversations)
        for i, conv in enumerate(conversations):
            if status[i] is not None or not conv or chat is None:
                continue
            if self.system_text is not None and conv[0].get("role") != "system":
                conv = [{"role": "system", "content": self.system_text}, *conv]
            try:
                out[i] = chat.render(conv)
            except Exception as e:  # only the template runs here: any error is its own
                status[i] = STATUS_CHAT_TEMPLATE
                why = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
                name = os.path.basename(chat.source)
                message[i] = f"chat template {name} refused the row: {why}"
        return out


def _text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def make_builder(
    cfg: InputConfig,
    model: ModelConfig | None,
    *,
    messages_col: str | None = None,
    prompt_column: str | None = None,
    error_column: str | None = None,
    text_prompts: bool = True,
    chat_prompts: bool = True,
) -> PromptBuilder | None:
    """The job's builder, or None when the prompt column is the exact model input.

    ``model`` None: metadata only (schema checks; nothing is rendered). The keyword
    arguments let a reader (OpenAI JSONL) name the columns it made; ``chat_prompts`` False:
    a prompt is raw text, never a chat turn, whatever the chat settings (/v1/completions)."""
    messages_col = messages_col or cfg.messages_column
    setting = model.chat_template if model is not None else None
    wrap = messages_col is None and (setting not in (None, "none") or cfg.system_prompt is not None)
    wrap = wrap and chat_prompts
    template = PromptTemplate.parse(cfg.template) if cfg.template else None
    if template is None and messages_col is None and not wrap and error_column is None:
        return None
    if template is None and messages_col is None and not text_prompts:
        if wrap:
            raise InputDataError(
                f"column {cfg.prompt_column!r} holds token ids; a chat template "
                "(model.chat_template / input.system_prompt) needs text prompts"
            )
        return None
    chat = None
    loaded = model is not None and (messages_col is not None or wrap)
    if loaded and model is not None:
        chat = load_chat_template(model.tokenizer_path, setting)  # tokenizer_config.json's
        if chat is None:
            raise missing_template(model.tokenizer_path)
    return PromptBuilder(
        prompt_column=prompt_column or cfg.prompt_column,
        template=template,
        messages_col=messages_col,
        system_text=cfg.system_prompt,
        wrap_prompts=wrap,
        chat=chat,
        error_column=error_column,
    )
