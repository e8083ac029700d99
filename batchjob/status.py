"""Every row status a result can carry, declared once. ``ok`` is success; every other value
names what was wrong with that row (the row's ``message`` column says more). The job goes on:
a bad row never stops the others."""

from __future__ import annotations

STATUS_OK = "ok"
# rejected while reading or tokenizing
STATUS_EMPTY_PROMPT = "empty_prompt"
STATUS_PROMPT_TOO_LONG = "prompt_too_long"
STATUS_INVALID_TOKENS = "invalid_tokens"
STATUS_INVALID_MAX_TOKENS = "invalid_max_tokens"
STATUS_NULL_FIELD = "null_field"  # input.template names a column that is null in this row
STATUS_CHAT_TEMPLATE = "chat_template_error"  # the chat template refused the row's messages
STATUS_INVALID_REQUEST = "invalid_request"  # an OpenAI Batch line that is not a valid request
# a per-row setting column (input.<name>_column) holding a value the setting refuses
STATUS_INVALID_SETTING = {
    "temperature_column": "invalid_temperature",
    "top_p_column": "invalid_top_p",
    "top_k_column": "invalid_top_k",
    "seed_column": "invalid_seed",
    "stop_column": "invalid_stop",
    "min_p_column": "invalid_min_p",
    "presence_penalty_column": "invalid_presence_penalty",
    "frequency_penalty_column": "invalid_frequency_penalty",
    "repetition_penalty_column": "invalid_repetition_penalty",
    "min_tokens_column": "invalid_min_tokens",
    "logit_bias_column": "invalid_logit_bias",
    "allowed_token_ids_column": "invalid_allowed_token_ids",
    "labels_column": "invalid_labels",
    "json_schema_column": "invalid_json_schema",
    "regex_column": "invalid_regex",
    "choice_column": "invalid_choice",
    "n_column": "invalid_n",
}
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
