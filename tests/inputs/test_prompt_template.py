"""input.template: parsing, the polars builder against Python's str.format, per-row nulls,
dataset-level errors (exit 4 naming the column), and the prompts reaching the tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from batchjob.config import load_job
from batchjob.errors import EXIT_CONFIG, EXIT_INPUT, ConfigError, InputDataError
from batchjob.inputs.parquet import open_dataset
from batchjob.inputs.template import PromptTemplate, parse_template
from batchjob.status import STATUS_NULL_FIELD
from batchjob.tokenize.batched import load_prompts
from tests.conftest import write_parquet

TEMPLATE = "Article: {title}\n\n{context}\n\nQuestion: {question}\nAnswer:"


def test_parse_placeholders_and_escapes() -> None:
    assert parse_template("a {x} b {{y}} {z}}}") == (("a ", "x"), (" b {y} ", "z"), ("}", None))
    assert parse_template("no columns {{}}") == (("no columns {}", None),)
    assert PromptTemplate.parse("{a}{b}{a}").columns == ("a", "b")
    assert parse_template("{col with space}") == (("", "col with space"),)


@pytest.mark.parametrize("bad", ["{", "a {x", "}", "a } b", "{}", "{ }", "{a{b}"])
def test_parse_rejects_lone_braces(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_template(bad)


def test_bad_template_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"input\.template: .*unclosed") as e:
        load_job(None, {"input.path": "x.parquet", "input.template": "Q: {q", "output.path": "o"})
    assert e.value.exit_code == EXIT_CONFIG
    with pytest.raises(ConfigError, match=r"input\.template: cannot be combined"):
        load_job(
            None,
            {
                "input.path": "x.parquet",
                "input.template": "{q}",
                "input.messages_column": "m",
                "output.path": "o",
            },
        )


def test_render_matches_str_format_with_nulls_and_types() -> None:
    rng = np.random.default_rng(0)
    n = 500
    words = np.array(["alpha", "beta", "gamma {x}", "δέλτα", "", "  pad "], dtype=object)
    title = [None if rng.random() < 0.05 else str(w) for w in rng.choice(words, n)]
    context = [str(w) * 3 for w in rng.choice(words, n)]
    question = rng.integers(-5, 1000, n)
    table = pa.table(
        {
            "title": pa.array(title, pa.string()).dictionary_encode(),  # a pandas categorical
            "context": pa.array(context, pa.large_string()),
            "question": pa.array(question, pa.int32()),
        }
    )
    tpl = PromptTemplate.parse(TEMPLATE + " {{done}}")
    prompts, null_col = tpl.render(table)
    assert prompts.type == pa.large_string()
    for i in range(n):
        if title[i] is None:
            assert prompts[i].as_py() is None and null_col[i] == "title"
        else:
            want = (TEMPLATE + " {{done}}").format(
                title=title[i], context=context[i], question=int(question[i])
            )
            assert prompts[i].as_py() == want and null_col[i] is None


def test_first_null_column_is_named() -> None:
    table = pa.table({"a": ["x", None, None], "b": [None, "y", None]})
    _, null_col = PromptTemplate.parse("{a}-{b}").render(table)
    assert list(null_col) == ["b", "a", "a"]


def _job(tmp: Path, data: Path, model: Path | None, **sets: str):
    over = {"input.path": str(data), "output.path": str(tmp / "out.parquet"), **sets}
    if model is not None:
        over["model.path"] = str(model)
    return load_job(None, over)


def test_missing_column_is_exit_4_naming_it(tmp_path: Path) -> None:
    data = write_parquet(pa.table({"title": ["t"], "context": ["c"]}), tmp_path / "d.parquet")
    job = _job(tmp_path, data, None, **{"input.template": TEMPLATE})
    with pytest.raises(InputDataError, match=r"'question' .*input.template.* not found") as e:
        open_dataset(job.input)
    assert e.value.exit_code == EXIT_INPUT


def test_unprintable_column_is_exit_4(tmp_path: Path) -> None:
    data = write_parquet(pa.table({"q": pa.array([[1, 2]])}), tmp_path / "d.parquet")
    job = _job(tmp_path, data, None, **{"input.template": "Q: {q}"})
    with pytest.raises(InputDataError, match=r"'q' .*has type list<.*cannot print"):
        open_dataset(job.input)


def test_template_rows_tokenize_and_null_rows_get_a_status(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    table = pa.table(
        {
            "title": ["river", "river", None, "stone"],
            "context": ["alpha beta", "alpha beta", "x", "gamma"],
            "question": ["why", "how", "what", None],
            "prompt": ["unrelated", "column", "kept", "as is"],
        }
    )
    data = write_parquet(table, tmp_path / "d.parquet")
    job = _job(tmp_path, data, tiny_model_dir, **{"input.template": TEMPLATE})
    loaded, _ = load_prompts(job.input, job.model, job.sampling, "native")
    assert loaded.prompts.row_ids.tolist() == [0, 1]
    assert loaded.rejected.row_ids.tolist() == [2, 3]
    assert loaded.rejected.status == (STATUS_NULL_FIELD, STATUS_NULL_FIELD)
    assert "row 2 " in loaded.rejected.message[0] and "'title'" in loaded.rejected.message[0]
    assert "'question'" in loaded.rejected.message[1]
    # plain-text tokenization of the built prompt (BOS added as for any text column)
    from batchjob.tokenize.tokenizer import load_tokenizer

    want, _ = load_tokenizer(tiny_model_dir).encode(
        [TEMPLATE.format(title="river", context="alpha beta", question="why")]
    )
    p = loaded.prompts
    assert p.tokens[p.offsets[0] : p.offsets[1]].tolist() == want.tolist()
    # every input column passes through, the unrelated "prompt" column included
    assert {"title", "context", "question", "prompt"} <= set(loaded.passthrough.column_names)
