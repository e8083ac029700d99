from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.testing.workloads import MICRO, WORDS, WORKLOADS, make_workload
from batchjob.tokenize.tokenizer import load_tokenizer
from examples.generate_workloads import main as generate


def rows_of(table: pa.Table) -> list[list[int]]:
    return table["prompt"].to_pylist()


def lcp(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def group_stats(table: pa.Table, group_col: str) -> tuple[np.ndarray, dict[int, list[list]]]:
    groups: dict[int, list[list]] = {}
    for g, p in zip(table[group_col].to_pylist(), rows_of(table), strict=True):
        groups.setdefault(g, []).append(p)
    sizes = np.array([len(v) for v in groups.values()])
    return sizes, groups


def shared_len(members: list[list]) -> int:
    return min(lcp(members[0], m) for m in members[1:])


@pytest.mark.parametrize("name", MICRO)
def test_micro_shapes(name: str) -> None:
    _, p, d, s = name.split("-")
    p, d, s = int(p), int(d), int(s[1:])
    t = make_workload(name, scale=0.25, len_scale=0.05, seed=1, vocab_size=1000)
    assert t.num_rows == 256
    sizes, groups = group_stats(t, "group_id")
    assert set(sizes.tolist()) == {s}
    pl, dl = round(p * 0.05), round(d * 0.05)
    assert all(len(r) == pl + dl for r in rows_of(t))
    ids = np.concatenate([np.asarray(r) for r in rows_of(t)])
    assert ids.min() >= 16 and ids.max() < 1000
    for members in groups.values():
        assert shared_len(members) == pl  # exactly the prefix: heads of suffixes differ
    heads = [m[0][0] for m in groups.values()]
    assert len(set(heads)) == len(heads)  # groups do not share a first token
    assert t["max_tokens"].to_pylist() == [5] * 256  # 100 * len_scale


def test_case1_shape() -> None:
    t = make_workload("case1", scale=1.0, len_scale=0.05, seed=3)
    assert t.num_rows == 3000
    sizes, groups = group_stats(t, "doc_id")
    assert 6.3 < sizes.mean() < 7.7 and sizes.min() >= 1 and sizes.std() > 1  # varies
    rows = rows_of(t)
    instr = lcp(rows[0], next(r for r in rows if r[31] != rows[0][31]))
    assert instr == round(30 * 0.05)  # one instruction shared by every row...
    assert all(r[:instr] == rows[0][:instr] for r in rows)
    prefix = [shared_len(m) for m in groups.values() if len(m) > 1]
    assert 50 < np.mean(prefix) < 60  # ...then ~1100 tokens shared per document
    lens = np.array([len(r) for r in rows])
    assert 70 < lens.mean() < 80 and lens.std() > 0  # 1100 + 400 = 1500, scaled by 0.05
    assert t["max_tokens"].to_pylist() == [5] * 3000
    assert len(set(t["query_id"].to_pylist())) == 3000
    # rows are shuffled: not in generation order
    assert t["request_id"].to_pylist() != list(range(3000))


def test_case2_shape() -> None:
    t = make_workload("case2", scale=1.0, len_scale=0.1, seed=0)
    assert t.num_rows == 1000
    sizes, groups = group_stats(t, "query_id")
    assert 10 < sizes.mean() < 12.7
    prefix = [shared_len(m) for m in groups.values() if len(m) > 1]
    assert 72 < np.mean(prefix) < 82  # ~770
    lens = np.array([len(r) for r in rows_of(t)])
    assert 165 < lens.mean() < 185  # 770 + 978 = 1748, scaled by 0.1


def test_nosharing_shape() -> None:
    t = make_workload("nosharing", seed=0, vocab_size=5000)
    assert t.num_rows == 1000 and all(len(r) == 512 for r in rows_of(t))
    mt = np.asarray(t["max_tokens"].to_pylist())
    assert 110 < mt.mean() < 140 and mt.min() >= 1 and mt.max() <= 1536 and mt.std() > 80
    heads = [r[0] for r in rows_of(t)]
    assert len(set(heads)) == 1000  # no two prompts share even one token


def test_long_doc_shape() -> None:
    """Documents of 1,500-3,500 tokens, each asked 5-100 questions of 10-30 tokens, behind one
    20-token instruction; 32 output tokens; rows shuffled."""
    t = make_workload("long-doc", scale=0.5, seed=3)
    prompts = [np.asarray(p) for p in t.column("prompt").to_pylist()]
    docs = t.column("doc_id").to_numpy()
    sizes = np.bincount(docs)
    assert t.num_rows == 500 and (sizes[:-1] >= 5).all() and (sizes <= 100).all()
    assert set(t.column("max_tokens").to_pylist()) == {32}
    assert not np.array_equal(docs, np.sort(docs))  # shuffled
    instr = prompts[0][:20]
    for d in np.unique(docs):
        rows = [p for p, di in zip(prompts, docs, strict=True) if di == d]
        if len(rows) < 2:
            continue
        a, b = rows[0], rows[1]
        n = min(len(a), len(b))
        common = int(np.argmin(np.r_[a[:n] == b[:n], False]))  # instruction + document
        assert 20 + 1500 <= common <= 20 + 3500, common
        for p in rows:
            assert np.array_equal(p[:20], instr) and np.array_equal(p[:common], a[:common])
            assert 10 <= len(p) - common <= 30


def test_seeded_determinism_and_scale() -> None:
    for name in WORKLOADS:
        a = make_workload(name, scale=0.05, len_scale=0.02, seed=5)
        assert a.equals(make_workload(name, scale=0.05, len_scale=0.02, seed=5))
        assert not a.equals(make_workload(name, scale=0.05, len_scale=0.02, seed=6))
    assert make_workload("case1", scale=0.1, len_scale=0.02).num_rows == 300
    t = make_workload("case1", scale=0.05, len_scale=0.02, max_tokens=9)
    assert set(t["max_tokens"].to_pylist()) == {9}
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("case3")


def test_text_form_keeps_prefixes_shared_after_tokenization(tiny_model_dir: Path) -> None:
    t = make_workload("case1", scale=0.02, len_scale=0.05, seed=2, form="text")
    assert pa.types.is_string(t["prompt"].type)
    words = set(WORDS)
    texts = t["prompt"].to_pylist()
    assert all(set(s.split(" ")) <= words for s in texts)
    tok = load_tokenizer(tiny_model_dir)
    tokens, lengths = tok.encode(texts)
    ends = np.cumsum(lengths)
    seqs = [tokens[e - n : e].tolist() for e, n in zip(ends, lengths, strict=True)]
    by_doc: dict[int, list[list[int]]] = {}
    for d, s in zip(t["doc_id"].to_pylist(), seqs, strict=True):
        by_doc.setdefault(d, []).append(s)
    for members in by_doc.values():
        if len(members) > 1:
            # BOS + instruction + document words, each word about one token
            assert shared_len(members) >= 1 + round(30 * 0.05) + 0.8 * round(1070 * 0.05 * 0.85)


def test_generator_cli(tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(generate, ["--list"])
    assert r.exit_code == 0 and r.output.split() == WORKLOADS
    out = tmp_path / "c1.parquet"
    args = ["case1", "--out", str(out), "--scale", "0.02", "--len-scale", "0.02", "--seed", "4"]
    r = runner.invoke(generate, args)
    assert r.exit_code == 0, r.output
    assert pq.read_table(out).equals(make_workload("case1", 0.02, 0.02, 4))
    args = ["case2", "--out", str(tmp_path / "d"), "--num-files", "3", "--form", "text"]
    r = runner.invoke(generate, [*args, "--scale", "0.03", "--len-scale", "0.02"])
    assert r.exit_code == 0, r.output
    parts = sorted((tmp_path / "d").glob("*.parquet"))
    assert len(parts) == 3
    whole = pa.concat_tables([pq.read_table(p) for p in parts])
    assert whole.equals(make_workload("case2", 0.03, 0.02, 0, "text"))
    r = runner.invoke(generate, ["nope", "--out", str(out)])
    assert r.exit_code == 2 and "unknown workload" in r.output
