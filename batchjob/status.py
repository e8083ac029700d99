"""Every row status a result can carry, declared once. ``ok`` is success; every other value
names what was wrong with that row (the row's ``message`` column says more). The job goes on:
a bad row never stops the others."""

from __future__ import annotations

from batchjob.config.per_row import ROW_SETTINGS

STATUS_OK = "ok"
# rejected while reading or tokenizing
STATUS_EMPTY_PROMPT = "empty_prompt"
STATUS_PROMPT_TOO_LONG = "prompt_too_long"
STATUS_INVALID_TOKENS = "invalid_tokens"
STATUS_INVALID_MAX_TOKENS = "invalid_max_tokens"
STATUS_NULL_FIELD = "null_field"  # input.template names a column that is null in this row
STATUS_CHAT_TEMPLATE = "chat_template_error"  # the chat template refused the row's messages
STATUS_INVALID_REQUEST = "invalid_request"  # an OpenAI Batch line that is not a valid request
STATUS_INVALID_ADAPTER = "invalid_adapter"  # input.adapter_column names no model.adapters entry
# a per-row setting column (input.<name>_column) holding a value the setting refuses: its
# status is the setting's (batchjob.config.per_row.ROW_SETTINGS)
STATUS_INVALID_SETTING = {s.column: s.status for s in ROW_SETTINGS}  # "invalid_<name>"
# set while running
STATUS_KV_BUDGET = "kv_budget_exceeded"  # the row cannot fit the KV cache even alone
STATUS_JSON_INCOMPLETE = "json_incomplete"  # max_tokens ended a structured output early
STATUS_REGEX_INCOMPLETE = "regex_incomplete"  # max_tokens ended before the regex matched
STATUS_CHOICE_INCOMPLETE = "choice_incomplete"  # max_tokens ended before a choice was complete
# the status of an output its constraint (json, regex, choice: config.guided) left unfinished
STATUS_INCOMPLETE = {
    "json": STATUS_JSON_INCOMPLETE,
    "regex": STATUS_REGEX_INCOMPLETE,
    "choice": STATUS_CHOICE_INCOMPLETE,
}
