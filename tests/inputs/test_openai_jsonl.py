"""OpenAI Batch request files: parsing into rows, per-line rejections naming the line,
file-level errors (exit 4), and the rows reaching the tokenizer (chat or completions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.errors import EXIT_INPUT, EXIT_MODEL, InputDataError, ModelError
from batchjob.inputs.openai_batch import read_requests
from batchjob.status import STATUS_INVALID_REQUEST
from batchjob.tokenize.tokenizer import load_tokenizer
from tests.conftest import load_rows

CHAT = "/v1/chat/completions"


def _req(i: int, url: str = CHAT, **body) -> str:
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": f"alpha river {i}"}])
    else:
        body.setdefault("prompt", f"alpha river {i}")
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body})


def _write(tmp: Path, lines: list[str]) -> Path:
    path = tmp / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_rows_and_per_line_rejections(tmp_path: Path) -> None:
    lines = [
        _req(0, max_tokens=5, temperature=0.5, top_p=0.9, seed=7, stop="x", model="m"),
        "{not json",
        "",  # blank lines are not requests
        _req(2, messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}]),
        _req(3, best_of=2),
        json.dumps({"custom_id": "c4", "url": CHAT}),  # no body
        _req(0),  # custom_id repeats line 1
        _req(6, max_tokens="5"),
        _req(7, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
    ]
    table, url = read_requests(str(_write(tmp_path, lines)))
    assert url == CHAT
    rows = table.to_pylist()
    assert [r["line"] for r in rows] == [1, 2, 4, 5, 6, 7, 8, 9]
    assert [r["custom_id"] for r in rows] == ["c0", None, "c2", "c3", "c4", "c0", "c6", "c7"]
    first = rows[0]
    assert (first["max_tokens"], first["temperature"], first["top_p"]) == (5, 0.5, 0.9)
    assert (first["seed"], first["stop"], first["model"]) == (7, ["x"], "m")
    assert first["messages"] == [{"role": "user", "content": "alpha river 0"}]
    n_row = read_requests(str(_write(tmp_path, [_req(0, n=3)])))[0].to_pylist()[0]
    assert n_row["n"] == 3 and not n_row["_request_error"]  # samples: input.n_column = "n"
    assert (
        rows[2]["messages"] == [{"role": "user", "content": "a"}] and not rows[2]["_request_error"]
    )
    errors = {r["line"]: r["_request_error"] for r in rows if r["_request_error"]}
    assert set(errors) == {2, 5, 6, 7, 8, 9}
    assert errors[2].startswith(f"{STATUS_INVALID_REQUEST}\tline 2: invalid JSON")
    assert "body.best_of = 2 is not honoured" in errors[5] and "body must be" in errors[6]
    assert "repeats line 1" in errors[7] and "body.max_tokens must be an integer" in errors[8]
    assert "text parts" in errors[9]


@pytest.mark.parametrize(
    "lines, match",
    [
        ([], "holds no request lines"),
        ([_req(0), _req(1, url="/v1/completions")], "line 2: url /v1/completions differs"),
    ],
)
def test_file_level_errors_are_exit_4(tmp_path: Path, lines: list[str], match: str) -> None:
    with pytest.raises(InputDataError, match=match) as e:
        read_requests(str(_write(tmp_path, lines)))
    assert e.value.exit_code == EXIT_INPUT


def test_completions_rows_tokenize_as_plain_text(tmp_path: Path, tiny_model_dir: Path) -> None:
    url = "/v1/completions"
    path = _write(tmp_path, [_req(0, url, max_tokens=3), _req(1, url), "[1, 2]"])
    loaded = load_rows(tmp_path, path, tiny_model_dir)
    tok = load_tokenizer(tiny_model_dir)
    want, _ = tok.encode(["alpha river 0"])  # BOS added: /v1/completions takes the text as is
    p = loaded.prompts
    assert p.tokens[p.offsets[0] : p.offsets[1]].tolist() == want.tolist()
    assert p.max_tokens.tolist() == [3, 128]  # body.max_tokens, else sampling.max_tokens
    assert loaded.rejected.status == (STATUS_INVALID_REQUEST,)
    assert "line 3: bad request: a request must be a JSON object" in loaded.rejected.message[0]
    assert {"custom_id", "line", "url", "model"} <= set(loaded.passthrough.column_names)
    assert "_request_error" not in loaded.passthrough.column_names


def test_chat_rows_need_a_template(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = _write(tmp_path, [_req(0)])
    with pytest.raises(ModelError, match=r"model\.chat_template") as e:
        load_rows(tmp_path, path, tiny_model_dir)
    assert e.value.exit_code == EXIT_MODEL
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}>")
    loaded = load_rows(tmp_path, path, tiny_model_dir, **{"model.chat_template": str(template)})
    tok = load_tokenizer(tiny_model_dir)
    want, _ = tok.encode(["[user] alpha river 0\n>"], add_special_tokens=False)
    p = loaded.prompts
    assert p.tokens.tolist() == want.tolist()


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
_bodies = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", 3]), "content": _json_values}
            ),
            max_size=2,
        )
        | _json_values,
        "prompt": st.text(max_size=10) | _json_values,
        "max_tokens": st.integers(-(2**70), 2**70) | _json_values,
        "temperature": st.floats() | _json_values,
        "seed": st.integers(-(2**70), 2**70),
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2) | _json_values,
        "n": st.integers(0, 3),
    },
)
_lines = st.one_of(
    st.builds(
        lambda cid, body, method: json.dumps(
            {"custom_id": cid, "method": method, "url": CHAT, "body": body}
        ),
        st.text(max_size=4) | _json_values,
        _bodies,
        st.sampled_from(["POST", "GET"]),
    ),
    st.text(max_size=20).filter(lambda s: "\n" not in s and "\r" not in s),
    st.binary(max_size=12)
    .filter(lambda b: b"\n" not in b and b"\r" not in b)
    .map(lambda b: b.decode("latin-1")),
)


@settings(max_examples=40, derandomize=True, deadline=None)
@given(lines=st.lists(_lines, min_size=1, max_size=6))
def test_fuzzed_request_files_never_crash(lines: list[str]) -> None:
    """Any file: rows for every non-blank line, or InputDataError; never another error."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f.jsonl"
        path.write_bytes("\n".join(lines).encode("utf-8", errors="surrogateescape") + b"\n")
        try:
            table, url = read_requests(str(path))
        except InputDataError as e:
            assert "holds no request lines" in str(e) or "differs" in str(e)
            return
    want = sum(1 for line in lines if line.encode("utf-8", "surrogateescape").strip())
    assert table.num_rows == want
    ok = [r for r in table.to_pylist() if r["_request_error"] is None]
    assert all(r["custom_id"] and (r["messages"] or r.get("prompt")) for r in ok)
    assert url == CHAT
