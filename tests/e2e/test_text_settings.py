"""vLLM's output-text settings on the native engine (the vLLM backend's test:
tests/backends/vllm/test_vllm_text_settings.py): ``skip_special_tokens``,
``spaces_between_special_tokens``, ``include_stop_str_in_output``, ``bad_words``.
(``scheduler.max_num_seqs`` under batchllm: tests/backends/native/test_scheduler_properties.py.)"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import batchjob
from batchjob.config import SamplingConfig
from batchjob.tokenize.bad_words import bad_words_token_ids, banned_next
from batchjob.tokenize.tokenizer import detokenize, load_tokenizer

ENGINE = {"kv_cache_bytes": "8MiB", "threads": 1}
PROMPTS = ["babu bado bafe bake", "bado bafe bake babu bado"]


def _generate(model, **sampling):
    return batchjob.generate(PROMPTS, model=model, sampling=sampling, engine=ENGINE)


def test_special_tokens_in_the_text(run_model):
    eos = load_tokenizer(run_model).eos_token_id
    assert eos is not None
    forced = {"max_tokens": 1, "logit_bias": {eos: 100}}  # every row: EOS, then done
    out = _generate(run_model, **forced)
    assert out["output_token_ids"].to_pylist() == [[eos], [eos]]
    assert out["output_text"].to_pylist() == ["", ""]  # vLLM's default: left out
    kept = _generate(run_model, **forced, skip_special_tokens=False)
    assert kept["output_text"].to_pylist() == ["</s>", "</s>"]


def test_spaces_between_special_tokens_as_vllm_detokenizes():
    """A decoder that puts spaces between tokens (WordPiece): two added tokens in a row are
    joined with no space when ``spaces_between_special_tokens`` is off, as vLLM's fast
    detokenizer does; the rest decodes as usual."""
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["<s>", "</s>"])
    ids = [0, tok.token_to_id("<s>"), tok.token_to_id("</s>"), 1]
    kept = SamplingConfig(skip_special_tokens=False)
    tight = SamplingConfig(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert detokenize(tok, [ids], kept) == ["a <s> </s> b"]
    assert detokenize(tok, [ids], tight) == ["a <s></s> b"]
    skipped = SamplingConfig(spaces_between_special_tokens=False)
    assert detokenize(tok, [ids], skipped) == ["a b"]  # nothing to space


def test_include_stop_str_in_output(run_model):
    free = _generate(run_model, max_tokens=8)["output_text"].to_pylist()[0]
    words = free.split()
    assert len(words) >= 3, free
    stop = " " + words[1]
    at = free.find(stop)
    cut = _generate(run_model, max_tokens=8, stop=[stop])
    kept = _generate(run_model, max_tokens=8, stop=[stop], include_stop_str_in_output=True)
    assert cut["output_text"][0].as_py() == free[:at]
    assert kept["output_text"][0].as_py() == free[: at + len(stop)]
    assert kept["output_token_ids"][0] == cut["output_token_ids"][0]  # same tokens, as vLLM
    assert kept["finish_reason"][0].as_py() == "stop"


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    return any(tuple(seq[i : i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_words_never_generated(run_model):
    free = _generate(run_model, max_tokens=16)
    tok = load_tokenizer(run_model)
    # a word the free run generates as vLLM encodes a bad word (" word" too only where it
    # has as many tokens as "word"): a span of output tokens that decodes to such a word
    spans = [
        (r, tuple(ids[i:j]))
        for r, ids in enumerate(free["output_token_ids"].to_pylist())
        for i in range(len(ids))
        for j in range(i + 1, min(i + 4, len(ids)) + 1)
    ]
    found = [
        (r, w, b)
        for r, span in spans
        if (w := tok.tokenizer.decode(list(span))).isalpha()
        and span in (b := bad_words_token_ids(tok, [w]))
    ]
    assert found, "no output span encodes as a bad word would"
    row, word, banned = found[0]
    out = _generate(run_model, max_tokens=16, bad_words=[word])
    for ids in out["output_token_ids"].to_pylist():
        assert not any(_contains(ids, b) for b in banned), (ids, banned)
    assert out["output_token_ids"][row] != free["output_token_ids"][row]


def test_banned_next_is_vllms_rule():
    bad = ((7,), (3, 4, 5))
    assert banned_next(bad, []) == [7]
    assert banned_next(bad, [1, 3, 4]) == [7, 5]
    assert banned_next(bad, [3, 4, 1]) == [7]
