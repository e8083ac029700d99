"""The model's tokenizer: load it once per job, encode prompts, decode outputs.

Special tokens follow ``transformers`` (5.x) ``tokenizer(text)``: add_special_tokens=True,
and the post-processor saved in tokenizer.json alone decides BOS/EOS (transformers ignores
``add_bos_token`` / ``add_eos_token`` of tokenizer_config.json when tokenizer.json exists;
``save_pretrained`` bakes them into the post-processor). tokenizer_config.json only names
the BOS/EOS tokens. Chat text (``batchjob.inputs.chat_template``) holds its special tokens already
and is encoded with ``add_special_tokens=False``, as ``apply_chat_template`` does.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from batchjob.config import SamplingConfig
from batchjob.errors import ModelError


@dataclass(frozen=True)
class PromptTokenizer:
    """A ``tokenizers.Tokenizer`` set up to encode prompts as the model expects."""

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_text_bytes_per_token(self) -> int:
        """Bytes of text one token can stand for, bounded from above: 4x the longest
        vocabulary string in UTF-8 (byte-level and sentencepiece spellings only overcount; 4x
        covers normalizers that shrink text). A text longer than max_model_len times this
        cannot fit and is rejected without tokenizing it."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return 4 * max((len(t.encode()) for t in vocab), default=1)

    def encode(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """-> (tokens int32 [sum L], lengths int64 [len(texts)]); one Rust call, parallel.
        ``add_special_tokens=False`` for chat text (it holds its BOS already, as in HF)."""
        encs = self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        ids = [e.ids for e in encs]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        tokens = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return tokens, lengths


def _token_str(v: object) -> str | None:
    if isinstance(v, dict):  # AddedToken serialised as {"content": ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def load_tokenizer(model_path: str | Path | None) -> PromptTokenizer:
    """Load ``tokenizer.json`` (+ ``tokenizer_config.json``) from a local model folder."""
    if model_path is None:
        raise ModelError("model.path: required (the model folder with tokenizer.json)")
    folder = Path(model_path)
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelError(
            f"{tok_file}: missing; a text prompt column needs the model's tokenizer.json "
            "(or give token ids in a list<int> column)"
        )
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise ModelError(f"{tok_file}: cannot load: {e}") from None
    cfg_file = folder / "tokenizer_config.json"
    cfg: dict = {}
    if cfg_file.is_file():
        try:
            cfg = json.loads(cfg_file.read_text())
        except ValueError as e:
            raise ModelError(f"{cfg_file}: invalid JSON: {e}") from None
    bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
    bos_id = tok.token_to_id(bos) if bos else None
    eos_id = tok.token_to_id(eos) if eos else None
    return PromptTokenizer(tok, bos_id, eos_id)


def detokenize(
    tokenizer: PromptTokenizer | Tokenizer,
    seqs: Sequence[np.ndarray | list[int]],
    text: SamplingConfig | None = None,
) -> list[str]:
    """Decode many token sequences in one batched (parallel) call, with vLLM's two settings
    of ``text`` (None: their defaults): ``skip_special_tokens`` leaves added special tokens
    out; kept, without ``spaces_between_special_tokens`` an added token right after another
    is joined to it with no space between (vLLM's detokenizer for fast tokenizers)."""
    text = text or SamplingConfig()
    tok = tokenizer.tokenizer if isinstance(tokenizer, PromptTokenizer) else tokenizer
    lists = [s.tolist() if isinstance(s, np.ndarray) else list(s) for s in seqs]
    skip = text.skip_special_tokens
    if skip or text.spaces_between_special_tokens:
        return tok.decode_batch(lists, skip_special_tokens=skip)
    added = set(tok.get_added_tokens_decoder())
    return [_decode_tight(tok, ids, added) for ids in lists]


def _decode_tight(tok: Tokenizer, ids: list[int], added: set[int]) -> str:
    """``ids`` decoded in runs that break before each added token following another, the
    runs joined with nothing between."""
    cuts = [0] + [j for j in range(1, len(ids)) if ids[j] in added and ids[j - 1] in added]
    bounds = zip(cuts, [*cuts[1:], len(ids)], strict=True)
    return "".join(tok.decode(ids[a:b], skip_special_tokens=False) for a, b in bounds)


def parallelism_disabled() -> bool:
    """True when TOKENIZERS_PARALLELISM turns the Rust thread pool off."""
    v = os.environ.get("TOKENIZERS_PARALLELISM")
    return v is not None and v.strip().lower() in ("", "0", "f", "false", "n", "no", "off")
