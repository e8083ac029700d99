"""The in-place glue of the native Llama forward equals HF's formulas bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchjob.backends.native.models import rope as rope_module
from batchjob.backends.native.models.llama import act_mul_, rms_norm
from batchjob.backends.native.models.rope import (
    RopeTable,
    apply_rope,
    apply_rope_,
    inv_frequencies,
    rope_cos_sin,
)
from batchjob.model.hf_config import RopeConfig

DTYPES = [torch.float32, torch.bfloat16]


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("scale", [1.0, 1.1902])  # 1.19: longrope's attention factor
def test_rope_in_place_on_fused_qkv_view_equals_hf(
    dtype: torch.dtype, head_dim: int, scale: float, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both the C pass (kernels/cpu/rope.c) and the torch ops rotate bit-equal to HF."""
    if path == "torch":
        monkeypatch.setattr(rope_module, "c_library", lambda: None)
    elif rope_module.c_library() is None:
        pytest.skip("no C compiler: the torch ops run")
    g = torch.Generator().manual_seed(head_dim)
    t, h, hkv = 37, 4, 2
    rope = RopeConfig(theta=10000.0, rope_type="default")
    inv = inv_frequencies(rope, head_dim)
    positions = torch.randint(0, 3000, (t,), generator=g)
    qkv = torch.randn(t, (h + 2 * hkv) * head_dim, generator=g).to(dtype)
    want_cos, want_sin = rope_cos_sin(positions, inv, dtype, scale)  # [T, 1, D]
    q = qkv[:, : h * head_dim].view(t, h, head_dim)
    k = qkv[:, h * head_dim : (h + hkv) * head_dim].view(t, hkv, head_dim)
    want_q, want_k = apply_rope(q, want_cos, want_sin), apply_rope(k, want_cos, want_sin)
    v_before = qkv[:, (h + hkv) * head_dim :].clone()

    table = RopeTable(dtype, scale)
    empty, _ = table.lookup(positions[:0], inv)  # an empty batch: an empty [0, 1, D/2]
    assert empty.shape == (0, 1, head_dim // 2)
    cos, sin = table.lookup(positions[:5], inv)  # a small table first: it must grow
    if path == "c":  # the engine's call: a host bound instead of reading the positions
        cos, sin = table.lookup(positions, inv, int(positions.max()) + 1)
    else:
        cos, sin = table.lookup(positions, inv)
    assert torch.equal(cos, want_cos[..., : head_dim // 2])
    assert torch.equal(sin, want_sin[..., : head_dim // 2])
    apply_rope_(qkv[:, : (h + hkv) * head_dim].view(t, h + hkv, head_dim), cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (h + hkv) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_hf(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(50, 256, generator=g) * 3).to(dtype)
    w = torch.randn(256, generator=g).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-6), hf_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_act_mul_in_place_equals_out_of_place(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(20, 2 * 48, generator=g).to(dtype)
    view = gate_up.clone()
    want = F.silu(view[:, :48]) * view[:, 48:]  # the split-view formula it replaces
    out = act_mul_(gate_up, 48)
    assert out.data_ptr() == gate_up.data_ptr()  # written into the gate half
    assert torch.equal(out, want)
    # HF runs silu on a contiguous gate: torch's strided and contiguous loops may differ
    # in the last bit, no more
    hf = F.silu(view[:, :48].contiguous()) * view[:, 48:]
    torch.testing.assert_close(out, hf, rtol=2e-7 if dtype == torch.float32 else 8e-3, atol=0)


def test_bf16_forward_is_as_close_to_hf_as_hf_bf16_is_to_float32(tmp_path) -> None:
    """dtype auto may pick bf16: our bf16 forward errs from HF's bf16 no more than bf16 does."""
    transformers = pytest.importorskip("transformers")
    from batchjob.backends.native.models import load_model
    from batchjob.testing.tiny_model import make_tiny_model
    from tests.backends.native.test_models_hf_parity import CORPUS, MiniEngine, Seq

    folder = make_tiny_model(tmp_path / "m", vocab_size=300, layers=2, corpus=CORPUS)
    model, info = load_model(folder, dtype="bfloat16", device="cpu", attention="auto")
    engine = MiniEngine(model, info, block_size=16)
    engine.cache = engine.cache.to(torch.bfloat16)
    ids = list(range(3, 60))
    ours = engine.step([(Seq(ids), len(ids))])[0]  # [T, V] float32 logits
    hf = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        ref16 = hf(folder, dtype=torch.bfloat16).eval()(torch.tensor([ids])).logits[0].float()
        ref32 = hf(folder, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    bf16_noise = (ref16 - ref32).abs().max()
    assert bf16_noise > 0
    assert (ours - ref16).abs().max() <= 2 * bf16_noise
    assert (ours - ref32).abs().max() <= 2 * bf16_noise


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlp_residual_fused_into_next_input_norm_equals_adding_it_first(
    tmp_path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer hands its MLP output to the next layer's input norm (one C pass in bf16 on
    the CPU): the logits equal those of adding it to the residual stream first."""
    from batchjob.backends.native.models import load_model
    from batchjob.backends.native.models.llama import DecoderLayer
    from batchjob.testing.tiny_model import make_tiny_model
    from tests.backends.native.test_models_hf_parity import CORPUS, MiniEngine, Seq

    folder = make_tiny_model(tmp_path / "m", vocab_size=300, layers=3, corpus=CORPUS)
    ids = list(range(3, 70))

    def logits() -> torch.Tensor:
        model, info = load_model(folder, dtype=dtype, device="cpu", attention="auto")
        engine = MiniEngine(model, info, block_size=16)
        engine.cache = engine.cache.to(getattr(torch, dtype))
        return engine.step([(Seq(ids), len(ids))])[0]

    fused = logits()

    def add_first(self, h, cos, sin, layer_cache, meta, backend, residual_delta=None):
        if residual_delta is not None:
            h.add_(residual_delta)
        q, k, v = self.pre_attention(h, cos, sin)
        return self.post_attention(h, self.attn.attend(q, k, v, layer_cache, meta, backend))

    monkeypatch.setattr(DecoderLayer, "forward", add_first)
    assert torch.equal(fused, logits())


def _norm_path(path: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch``: the norms run torch's ops; ``c``: glue.c where it applies (bf16)."""
    from batchjob.backends.native.models import cpu_glue

    if path == "torch":
        monkeypatch.setattr(cpu_glue, "_takes", lambda *ts: None)
    elif dtype == torch.bfloat16 and cpu_glue.c_library() is None:
        pytest.skip("no C compiler: the torch ops run")


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_scaled_in_float_equals_olmo2s(
    dtype: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OLMo2's RMSNorm scales by the weight in float32 and rounds once; bf16 differs from
    Llama's order (normalised x rounded first) in the last bit, and ours follows each: the
    torch ops bit for bit, the C pass (glue.c) but where the mean's float32 summation order
    tips a rounding (one bf16 step)."""
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    from batchjob.backends.native.models.llama import RMSNorm

    _norm_path(path, dtype, monkeypatch)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(300, 896, generator=g) * 3).to(dtype)
    w = (1 + 0.3 * torch.randn(896, generator=g)).to(dtype)
    ref = olmo2.Olmo2RMSNorm(896, eps=1e-6).to(dtype)
    ours = RMSNorm(896, 1e-6, dtype, scale_in_float=True)
    with torch.no_grad():
        ref.weight.copy_(w)
        ours.weight.copy_(w)
        want = ref(x)
    got = ours(x)
    if path == "torch" or dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        assert (got == want).float().mean().item() >= 0.999
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-30).all()
    if dtype == torch.bfloat16:  # the two orders really differ: the flag is needed
        llama_order = hf_rms_norm(x, w, 1e-6)
        assert (llama_order != want).float().mean().item() > 0.01


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_of_one_plus_weight_equals_gemma3s(
    dtype: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma3's RMSNorm scales by 1 + weight in float32 and rounds once: the weight folded
    into a float32 1 + w at load (fold_offset), then the torch ops bit for bit, the C pass
    (glue.c with a float32 weight) but where the mean's summation order tips a rounding;
    with the residual add fused in front, as a layer runs it."""
    gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    from batchjob.backends.native.models.llama import RMSNorm, add_rms_norm_

    _norm_path(path, dtype, monkeypatch)
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(300, 640, generator=g) * 3).to(dtype)
    d = torch.randn(300, 640, generator=g).to(dtype)
    w = (0.3 * torch.randn(640, generator=g)).to(dtype)  # Gemma's weights sit around 0
    ref = gemma3.Gemma3RMSNorm(640, eps=1e-6).to(dtype)
    ours = RMSNorm(640, 1e-6, dtype, scale_in_float=True, offset=1.0)
    with torch.no_grad():
        ref.weight.copy_(w)
        ours.weight.copy_(w)
        want = ref(x + d)
    ours.fold_offset()
    assert ours.weight.dtype == torch.float32 and ours.offset == 0.0
    h = x.clone()
    got = add_rms_norm_(h, d, ours)
    assert torch.equal(h, x + d)  # the residual stream updated in place
    if path == "torch" or dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        assert (got == want).float().mean().item() >= 0.999
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-30).all()
    if dtype == torch.bfloat16:  # 1 + w rounded to bf16 first would differ
        rounded = RMSNorm(640, 1e-6, dtype, scale_in_float=True)
        with torch.no_grad():
            rounded.weight.copy_(1 + w)
        assert (rounded(x + d) != want).float().mean().item() > 0.01
