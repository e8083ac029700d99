"""A tiny checkpoint whose greedy output is known: a forced-token test double.

``make_chain_model(out, [("Is it?", "<think>hm, well</think> yes")])`` writes a Llama-family
folder (config.json, model.safetensors, tokenizer.json with extra tokens such as ``<think>``)
whose greedy continuation of any prompt ending in ``Is it?`` is exactly the tokens of
``<think>hm, well</think> yes`` and then EOS, on every engine that runs the architecture
(batchjob's native engine, vLLM, transformers): each layer's output projections are zero, so
the last hidden state is the input token's embedding, and the LM head maps each token of a
chain to the next one. Every token of all chains must be distinct (a token has one
successor). Needs ``transformers`` (a dev dependency), imported lazily.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from batchjob.testing.tiny_model import (
    BOS,
    EOS,
    PAD,
    _config,
    default_corpus,
    save_model_folder,
    train_tokenizer,
)


@dataclass(frozen=True)
class ChainModel:
    path: Path
    outputs: tuple[tuple[int, ...], ...]  # per chain: the greedy output's token ids, EOS last
    eos_id: int


def make_chain_model(
    out_dir: str | Path,
    chains: Sequence[tuple[str, str]],
    family: str = "qwen3",
    added_tokens: Sequence[str] = ("<think>", "</think>"),
    vocab_size: int = 400,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
) -> ChainModel:
    """Write the model of ``chains`` ((prompt tail, output text) pairs) to ``out_dir``.

    ``added_tokens``: tokens added to the trained BPE vocabulary (not special: decoding keeps
    them); ``heads``: vLLM's CPU attention takes head sizes 32, 64, 80, ... (heads = 2 at
    hidden 64). ValueError when two chains, or one chain, use a token twice."""
    import transformers
    from tokenizers import AddedToken

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(default_corpus(seed=seed), vocab_size)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    tok.save(str(out / "tokenizer.json"))
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in (BOS, EOS, PAD))
    successor: dict[int, int] = {}
    outputs = []
    for prompt, text in chains:
        tail = tok.encode(prompt, add_special_tokens=False).ids[-1]
        ids = tok.encode(text, add_special_tokens=False).ids
        chain = [tail, *ids, eos_id]
        seen = [*successor, *chain[:-1]]
        if len(set(seen)) < len(seen):
            pieces = [tok.id_to_token(t) for t in chain]
            raise ValueError(f"{prompt!r} + {text!r}: a token repeats in {pieces}")
        successor.update(itertools.pairwise(chain))
        outputs.append((*ids, eos_id))
    config = _config(
        family,
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=None,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # each layer adds nothing: the last hidden state is the embedding
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
        emb = model.model.embed_tokens.weight
        emb.normal_()
        head = model.lm_head.weight
        head.zero_()
        for a, b in successor.items():  # logit of b after a: sqrt(hidden); others near 0
            head[b] += emb[a] / emb[a].norm()
    save_model_folder(out, model, (bos_id, eos_id, pad_id), max_position=4096)
    return ChainModel(out, tuple(outputs), eos_id)
