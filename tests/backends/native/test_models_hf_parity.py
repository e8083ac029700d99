"""Our Llama-family forward (paged KV, chunked prefill, shared prefixes) vs HF transformers."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field

import pytest
import torch

from batchjob.backends.native.models import load_model
from batchjob.kernels.reference import SeqSpec, build_metadata
from batchjob.model.info import read_model_info
from batchjob.testing.tiny_model import make_tiny_model

transformers = pytest.importorskip("transformers")

FAMILIES = [
    "llama", "mistral", "qwen2", "qwen3", "granite", "smollm3", "olmo2", "olmo3", "phi3", "gemma3",
]  # fmt: skip
# longrope on Phi3's partial rotary: with the long factors (the test's 11-token prompt is past
# the original context of 8, as every forward of HF's is) and with the short ones (a
# max_model_len within the original 64: HF's forwards, at most 35 tokens, use the short too)
LONGROPE = {"phi3-longrope-long": (8, None), "phi3-longrope-short": (64, 64)}
# sliding windows shorter than the test's sequences: every layer (Mistral), one of two (OLMo3)
WINDOWED = {
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "olmo3-window": (
        "olmo3",
        {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}
VARIANTS = [*FAMILIES, "llama-tied-llama3rope", "qwen2-linear-rope", *LONGROPE, *WINDOWED]
CORPUS = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine"] * 20


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {}
    for seed, family in enumerate(FAMILIES):
        out[family] = make_tiny_model(
            root / family, family=family, vocab_size=300, layers=2, seed=seed, corpus=CORPUS
        )
    out["llama-tied-llama3rope"] = make_tiny_model(
        root / "tied", family="llama", vocab_size=300, seed=7, corpus=CORPUS,
        tie_word_embeddings=True, heads=4, kv_heads=1,
    )  # fmt: skip
    _edit_config(
        out["llama-tied-llama3rope"],
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    )  # fmt: skip
    shutil.copytree(out["qwen2"], root / "qwen2-linear")
    out["qwen2-linear-rope"] = root / "qwen2-linear"
    _edit_config(out["qwen2-linear-rope"], rope_scaling={"type": "linear", "factor": 4.0})
    for name, (family, changes) in WINDOWED.items():
        shutil.copytree(out[family], root / name)
        out[name] = root / name
        _edit_config(out[name], **changes)
    rng = random.Random(3)
    for name, (original, _) in LONGROPE.items():
        shutil.copytree(out["phi3"], root / name)
        out[name] = root / name
        _edit_config(
            out[name], original_max_position_embeddings=original, max_position_embeddings=256,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1 + rng.random() for _ in range(4)],  # 8 of 16 dims rotated
                "long_factor": [2 + 8 * rng.random() for _ in range(4)],
            },
        )  # fmt: skip
    return out


def _load(folder, variant: str):
    """The variant's model as the native engine loads it for a job (its max_model_len)."""
    max_model_len = LONGROPE.get(variant, (0, None))[1]
    return load_model(read_model_info(folder, "float32", "cpu", max_model_len), attention="torch")


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    if "rope_scaling" in changes:  # legacy key: drop the v5 one so both parsers read the legacy
        cfg.pop("rope_parameters", None)
        cfg["rope_theta"] = 10000.0
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()  # [T, V]


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """HF's argmax, a full forward per step: EOS is a token like any other (``generate``'s
    ``min_new_tokens`` would mask it, where the engine under test picks it)."""
    x = torch.tensor([ids])
    for _ in range(n):
        x = torch.cat([x, hf(x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x[0, len(ids) :].tolist()


@dataclass
class Seq:
    tokens: list[int]  # own tokens: prompt (or prefix) then generated
    group: int = -1  # index into MiniEngine.groups
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # own tokens whose KV is in the cache


class MiniEngine:
    """Paged KV bookkeeping for the tests: shuffled block ids, groups made from prefix seqs."""

    def __init__(self, model, info, block_size: int, num_blocks: int = 128) -> None:
        self.model, self.bs = model, block_size
        self.cache = torch.zeros(info.kv_cache_shape(num_blocks, block_size))
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)
        self.groups: list[Seq] = []  # fully prefilled prefix sequences

    def step(self, items: list[tuple[Seq, int]]) -> list[torch.Tensor]:
        """Run ``n`` new tokens of each seq; returns each item's logits [n, V]."""
        specs, ids, pos = [], [], []
        for seq, n in items:
            kv = seq.cached + n
            while len(seq.blocks) * self.bs < kv:
                seq.blocks.append(self.free.pop())
            offset = self.groups[seq.group].cached if seq.group >= 0 else 0
            ids += seq.tokens[seq.cached : kv]
            pos += range(offset + seq.cached, offset + kv)
            specs.append(SeqSpec(n, kv, seq.group, tuple(seq.blocks)))
        meta = build_metadata(specs, self.bs, [(g.cached, g.blocks) for g in self.groups])
        t = len(ids)
        logits = self.model(torch.tensor(ids), torch.tensor(pos), self.cache, meta, torch.arange(t))
        for seq, n in items:
            seq.cached += n
        return list(logits.split([n for _, n in items]))


def _greedy_decode(engine: MiniEngine, seqs: list[Seq], first: list[torch.Tensor], steps: int):
    """Append argmax tokens to every seq for ``steps`` steps; returns per-step logits."""
    history = [[lg] for lg in first]
    for _ in range(steps):
        for seq, hist in zip(seqs, history, strict=True):
            seq.tokens.append(int(hist[-1][-1].argmax()))
        out = engine.step([(s, 1) for s in seqs])
        for hist, lg in zip(history, out, strict=True):
            hist.append(lg)
    return history


@pytest.mark.parametrize("variant", VARIANTS)
def test_single_sequence_chunked_prefill_and_decode(tiny_models, variant):
    folder = tiny_models[variant]
    model, info = _load(folder, variant)
    hf = _hf(folder)
    prompt = random.Random(1).choices(range(3, info.vocab_size), k=11)
    engine = MiniEngine(model, info, block_size=4)
    seq = Seq(list(prompt))
    chunks = [engine.step([(seq, n)])[0] for n in (5, 3, 3)]  # chunks split mid-block
    prefill = torch.cat(chunks)
    torch.testing.assert_close(prefill, _hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)
    steps = 24
    history = _greedy_decode(engine, [seq], [chunks[-1]], steps)[0]
    generated = seq.tokens[len(prompt) :]
    assert generated == _hf_greedy(hf, prompt, steps)
    if "tied" not in variant:  # tied tiny random models tend to repeat their input token
        assert len(set(generated)) > 3, "tiny model output collapsed to a repeated token"
    ref = _hf_logits(hf, seq.tokens)  # full sequence, every position
    ours = torch.cat([prefill, *history[1:]])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "variant",
    ["llama", "qwen3", "qwen2", "granite", "smollm3", "olmo2", "phi3", "gemma3", *WINDOWED],
)
def test_shared_prefix_members_decode_together(tiny_models, variant):
    folder = tiny_models[variant]
    model, info = load_model(folder, dtype="float32", device="cpu", attention="torch")
    hf = _hf(folder)
    rng = random.Random(2)
    vocab = range(3, info.vocab_size)
    prefix = Seq(rng.choices(vocab, k=10))  # 10 tokens: ends mid-block with block_size 4
    engine = MiniEngine(model, info, block_size=4)
    engine.step([(prefix, 6)])
    loose = Seq(rng.choices(vocab, k=7))  # a sequence outside the group, in the same batches
    engine.step([(prefix, 4), (loose, 3)])
    engine.groups.append(prefix)
    members = [Seq(rng.choices(vocab, k=n), group=0) for n in (3, 6, 1)]
    # one ragged batch: the loose prompt's last chunk, then the whole group (all prefills)
    out = engine.step([(loose, 4)] + [(m, len(m.tokens)) for m in members])
    seqs, first = [loose, *members], out
    full = [list(loose.tokens)] + [prefix.tokens + m.tokens for m in members]
    for lg, ids in zip(first, full, strict=True):
        torch.testing.assert_close(lg, _hf_logits(hf, ids)[-len(lg) :], atol=1e-4, rtol=1e-4)
    steps = 20
    history = _greedy_decode(engine, seqs, [lg[-1:] for lg in first], steps)
    for seq, hist, ids in zip(seqs, history, full, strict=True):
        n_prompt = len(ids)
        full_ids = (prefix.tokens if seq.group == 0 else []) + seq.tokens
        assert full_ids[n_prompt:] == _hf_greedy(hf, ids, steps)
        ref = _hf_logits(hf, full_ids)[n_prompt - 1 : n_prompt - 1 + steps + 1]
        torch.testing.assert_close(torch.cat(hist), ref, atol=1e-4, rtol=1e-4)


def test_logits_index_selects_rows(tiny_models):
    folder = tiny_models["llama"]
    model, info = load_model(folder, dtype="float32", device="cpu", attention="torch")
    ids = random.Random(3).choices(range(3, info.vocab_size), k=9)
    full = MiniEngine(model, info, block_size=16).step([(Seq(list(ids)), 9)])[0]
    engine = MiniEngine(model, info, block_size=16)
    seq = Seq(list(ids))
    seq.blocks.append(engine.free.pop())
    meta = build_metadata([SeqSpec(9, 9, blocks=tuple(seq.blocks))], 16)
    idx = torch.tensor([8, 2])
    some = model(torch.tensor(ids), torch.arange(9), engine.cache, meta, idx)
    assert some.shape == (2, info.vocab_size) and some.dtype == torch.float32
    torch.testing.assert_close(some, full[idx])


def test_bfloat16_weights_run(tiny_models):
    model, info = load_model(tiny_models["qwen3"], dtype="bfloat16", device="cpu")
    assert info.torch_dtype == torch.bfloat16 and info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    engine = MiniEngine(model, info, block_size=4)
    engine.cache = engine.cache.to(torch.bfloat16)
    ids = list(range(3, 15))
    ours = engine.step([(Seq(ids), len(ids))])[0]
    ref = _hf_logits(_hf(tiny_models["qwen3"]), ids)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()
