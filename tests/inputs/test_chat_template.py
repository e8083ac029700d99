"""Chat templates: batchjob's prompts token for token against transformers'
``AutoTokenizer.apply_chat_template(..., tokenize=True, add_generation_prompt=True)`` on a
tiny model folder with a real (Llama-3 / ChatML style) template; per-row refusals; errors."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import transformers

from batchjob.errors import EXIT_CONFIG, EXIT_MODEL, ConfigError, ModelError
from batchjob.status import STATUS_CHAT_TEMPLATE, STATUS_NULL_FIELD
from tests.conftest import load_rows, train_tiny_tokenizer, write_model_folder, write_parquet

LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)

# ChatML (Qwen style), as a chat_template.jinja file: block tags on their own lines (trim_blocks
# and lstrip_blocks matter), tojson of non-ASCII/HTML text, no BOS at all
CHATML = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
# last: {{ messages[-1]['content'] | tojson }}
{% endif %}"""

SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]

CONVERSATIONS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha river"}],
    [
        {"role": "user", "content": "  stone <b>&</b> é  "},
        {"role": "assistant", "content": "gamma"},
        {"role": "user", "content": "why\nnot"},
    ],
    [{"role": "user", "content": "alpha river"}],
]


def _folder(tmp: Path, name: str, tokenizer_config: dict | None = None) -> Path:
    tok = train_tiny_tokenizer()
    tok.add_special_tokens(SPECIALS)  # ids stay below the config's vocab (3000)
    assert tok.get_vocab_size() <= 3000
    return write_model_folder(tmp / name, tok, tokenizer_config)


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _folder(tmp_path_factory.mktemp("chat"), "llama3", {"chat_template": LLAMA3})


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = _folder(tmp_path_factory.mktemp("chat"), "chatml")
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder


def _hf_ids(folder: Path, messages: list[dict]) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _load(tmp: Path, table: pa.Table, folder: Path, **sets: str):
    return load_rows(tmp, write_parquet(table, tmp / "in.parquet"), folder, **sets)


def _boom_row(tmp: Path, folder: Path, body: str):
    """Two rows under a template that runs ``body`` on row 1 only (its content ``boom``): row 0
    tokenizes, row 1 is rejected with ``chat_template_error``."""
    template = tmp / "boom.jinja"
    template.write_text(
        "{% if messages[0]['content'] == 'boom' %}" + body + "{% endif %}"
        "{{ messages[0]['content'] }}"
    )
    table = pa.table({"messages": [CONVERSATIONS[0][1:], [{"role": "user", "content": "boom"}]]})
    sets = {"input.messages_column": "messages", "model.chat_template": str(template)}
    loaded = _load(tmp, table, folder, **sets)
    assert loaded.prompts.row_ids.tolist() == [0]
    assert loaded.rejected.status == (STATUS_CHAT_TEMPLATE,)
    return loaded


def _rows(loaded) -> list[list[int]]:
    p = loaded.prompts
    return [p.tokens[p.offsets[i] : p.offsets[i + 1]].tolist() for i in range(len(p))]


@pytest.mark.parametrize("which", ["llama3", "chatml"])
def test_messages_column_token_for_token(tmp_path: Path, which: str, request) -> None:
    folder = request.getfixturevalue(f"{which}_dir")
    convs = CONVERSATIONS if which == "chatml" else [CONVERSATIONS[0], CONVERSATIONS[2]]
    loaded = _load(
        tmp_path, pa.table({"messages": convs}), folder, **{"input.messages_column": "messages"}
    )
    assert len(loaded.rejected) == 0
    got = _rows(loaded)
    assert got == [_hf_ids(folder, c) for c in convs]
    if which == "llama3":  # BOS once: the template writes it, the tokenizer adds none
        assert got[0][0] == 1 and got[0][1] != 1 and got[0].count(1) == 1
    else:
        assert 1 not in got[0]


def test_prompt_as_user_turn_with_system_prompt(tmp_path: Path, llama3_dir: Path) -> None:
    table = pa.table({"q": ["alpha river", "stone gamma"], "doc": ["d1", "d2"]})
    loaded = _load(
        tmp_path,
        table,
        llama3_dir,
        **{"input.template": "{doc}: {q}", "input.system_prompt": "be brief"},
    )
    want = [
        _hf_ids(
            llama3_dir,
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{d}: {q}"}],
        )
        for q, d in zip(table["q"].to_pylist(), table["doc"].to_pylist(), strict=True)
    ]
    assert _rows(loaded) == want
    # identical system prompt and headers: a shared prefix the planner sees
    a, b = _rows(loaded)
    assert len(a) > 10 and a[:8] == b[:8]


def test_auto_wraps_a_plain_prompt_column_and_path_overrides(
    tmp_path: Path, llama3_dir: Path
) -> None:
    table = pa.table({"prompt": ["alpha river"]})
    user = [{"role": "user", "content": "alpha river"}]
    loaded = _load(tmp_path, table, llama3_dir, **{"model.chat_template": "auto"})
    assert _rows(loaded) == [_hf_ids(llama3_dir, user)]
    # unset: a plain prompt column stays the exact model input (BOS + text)
    plain = _load(tmp_path, table, llama3_dir)
    assert _rows(plain)[0][0] == 1 and 2877 not in _rows(plain)[0]
    # PATH: that template file instead of the folder's
    path = tmp_path / "chatml.jinja"
    path.write_text(CHATML)
    loaded = _load(tmp_path, table, llama3_dir, **{"model.chat_template": str(path)})
    hf = transformers.AutoTokenizer.from_pretrained(str(llama3_dir))
    want = hf.apply_chat_template(
        user, tokenize=True, add_generation_prompt=True, chat_template=CHATML
    )
    assert _rows(loaded) == [list(want["input_ids"] if hasattr(want, "keys") else want)]


def test_refused_and_null_rows_get_a_status(tmp_path: Path, llama3_dir: Path) -> None:
    bad = [{"role": "assistant", "content": "first"}]  # the template raises: not alternating
    table = pa.table({"messages": [CONVERSATIONS[0], bad, None, []]})
    loaded = _load(tmp_path, table, llama3_dir, **{"input.messages_column": "messages"})
    assert loaded.prompts.row_ids.tolist() == [0]
    assert loaded.rejected.status == (STATUS_CHAT_TEMPLATE, STATUS_NULL_FIELD, STATUS_NULL_FIELD)
    assert "roles must alternate" in loaded.rejected.message[0]
    assert loaded.rejected.message[0].startswith("row 1 ")
    assert "messages" not in loaded.passthrough.column_names


def test_errors_name_the_key(tmp_path: Path, tiny_model_dir: Path, llama3_dir: Path) -> None:
    table = pa.table({"messages": [CONVERSATIONS[0]]})
    with pytest.raises(ModelError, match=r"model.chat_template: .*no chat template") as e:
        _load(tmp_path, table, tiny_model_dir, **{"input.messages_column": "messages"})
    assert e.value.exit_code == EXIT_MODEL
    with pytest.raises(ConfigError, match=r"model.chat_template: 'none' cannot") as c:
        _load(
            tmp_path,
            table,
            llama3_dir,
            **{"input.messages_column": "messages", "model.chat_template": "none"},
        )
    assert c.value.exit_code == EXIT_CONFIG
    with pytest.raises(ConfigError, match=r"model.chat_template: .*not auto, none or a template"):
        _load(tmp_path, table, llama3_dir, **{"model.chat_template": "missing.jinja"})
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match=r"model.chat_template: .*invalid Jinja"):
        _load(tmp_path, table, llama3_dir, **{"model.chat_template": str(broken)})
    wrong = pa.table({"messages": ["not a list"]})
    with pytest.raises(Exception, match=r"input.messages_column.*list<struct"):
        _load(tmp_path, wrong, llama3_dir, **{"input.messages_column": "messages"})


def test_tokenizer_config_named_templates(tmp_path: Path) -> None:
    named = [{"name": "default", "template": LLAMA3}, {"name": "tool_use", "template": "x"}]
    folder = _folder(tmp_path, "named", {"chat_template": named})
    loaded = _load(
        tmp_path, pa.table({"m": [CONVERSATIONS[2]]}), folder, **{"input.messages_column": "m"}
    )
    assert _rows(loaded) == [_hf_ids(folder, CONVERSATIONS[2])]
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == named


@pytest.mark.parametrize(
    "body",
    [
        "{% for i in range(100000000) %}x{% endfor %}",  # the sandbox's OverflowError
        "{{ 1 // 0 }}",  # ZeroDivisionError
    ],
)
def test_a_template_that_fails_in_python_is_a_row_error(
    tmp_path: Path, llama3_dir: Path, body: str
) -> None:
    """Any error the template raises while rendering a row is that row's
    ``chat_template_error`` (it was a traceback, exit 1), the other rows run."""
    loaded = _boom_row(tmp_path, llama3_dir, body)
    assert loaded.rejected.message[0].startswith("row 1 ") and "Error" in loaded.rejected.message[0]


@pytest.mark.parametrize(
    "body",
    [
        "{{ 'x' * 10000000000 }}",  # issue 49: 9.9 GB in 60 s
        "{{ 'x' * 50000000 }}",  # 50 MB: rendered whole before
        "{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}"
        "{% endfor %}{% endfor %}{% endfor %}",  # issue 49: no output for 60 s
        "{% for a in range(3000) %}{% for b in range(3000) %}{% endfor %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s }}",
        "{% set ns = namespace(s=['x']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}"
        "{{ m(60) }}",
        "{{ 'x' | center(10000000000) }}",
        "{{ 'ab'.ljust(10000000000) }}",
        "{{ '%10000000000s' % 'x' }}",
        "{{ '{:>10000000000}'.format('x') }}",
        "{{ ('x' * 1000000) | replace('x', 'x' * 1000) }}",
        "{{ range(100000) | join('y' * 1000) }}",
        "{{ 2 ** 100000000000 }}",
        "{{ messages | tojson(indent=10000000000) }}",
    ],
)
def test_a_template_past_the_render_limits_is_a_row_error(
    tmp_path: Path, llama3_dir: Path, body: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's template is code run per row: time and size are bounded per render, an
    overrun rejects that row (``chat_template_error``) and the job goes on."""
    from batchjob.inputs import chat_template

    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.2)
    loaded = _boom_row(tmp_path, llama3_dir, body)
    message = loaded.rejected.message[0]
    assert message.startswith("row 1 ") and "the limit per row" in message, message
