"""Linear layers of few-row batches on the C kernel (kernels/cpu/linear.c, models/cpu_linear.py):
the kernel per ISA against torch's F.linear, the routing of PackedLinear, the model swap and
its guards, and the calibration that decides per layer shape and row bucket."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchjob.backends.native.models import cpu_linear, load_model, packed_weights
from batchjob.backends.native.models.cpu_linear import BUCKETS, PackedLinear, use_cpu_linear
from batchjob.backends.native.models.onednn_ops import onednn_available
from batchjob.config import EngineConfig
from batchjob.errors import ConfigError
from batchjob.kernels.cpu import build
from batchjob.testing.tiny_model import make_tiny_model
from tests.backends.native.test_model_loader import _logits  # one prompt's logits, no engine

ISAS = build.cpu_isas()
pytestmark = pytest.mark.skipif(build.load_kernel() is None, reason="no gcc")


def _close(got: torch.Tensor, want: torch.Tensor, k: int, ulps: float = 2.0) -> None:
    """fp32 sums of k products in another order: within a few ulps of the sum's magnitude."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=ulps * 1e-6 * k**0.5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_torch_linear(isa, bias):
    """Row counts around the tile heights (1-13, 64, 257), output columns not a multiple of
    the panel (37, 1000: a zero-padded last panel), odd K, and rows read with a stride (the
    down projection reads the gate half of gate_up in place)."""
    kernel = build.load_kernel(isa)
    g = torch.Generator().manual_seed(0)
    for n, k in ((37, 33), (1000, 64), (64, 256)):
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        layer = PackedLinear(w, b, kernel, calibrate=False)
        for m in (1, 2, 5, 6, 7, 11, 12, 13, 64, 257):
            wide = torch.randn(m, 2 * k, generator=g)
            for x in (wide[:, :k].contiguous(), wide[:, :k]):  # contiguous, row stride 2k
                _close(layer.kernel_forward(x), F.linear(x, w, b), k)


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_blocks_of_rows_and_k_match_torch(isa):
    """Prefill-sized inputs: more rows than a row block (240) and K over several K blocks
    (256; the last partial), so y carries partial sums between K blocks and the bias is
    added once; a partial last panel and strided rows as above. (The sums go through y
    between blocks, another order than torch's: 4 ulps of slack, not 2.)"""
    kernel = build.load_kernel(isa)
    g = torch.Generator().manual_seed(1)
    k = 600
    for n in (45, 300):
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        layer = PackedLinear(w, b, kernel, calibrate=False)
        for m in (241, 487):
            wide = torch.randn(m, 2 * k, generator=g)
            for x in (wide[:, :k].contiguous(), wide[:, :k]):
                _close(layer.kernel_forward(x), F.linear(x, w, b), k, ulps=4)


def test_packed_linear_routes_by_rows_dtype_and_layout():
    """The kernel for 2-D float32 rows up to the last bucket with inner stride 1; torch (the
    same bits as F.linear) otherwise."""
    kernel = build.load_kernel()
    w, b = torch.randn(48, 40), torch.randn(48)
    layer = PackedLinear(w, b, kernel, calibrate=False)
    calls = []
    run = layer.kernel_forward
    layer.kernel_forward = lambda x: calls.append(x.shape) or run(x)  # type: ignore[method-assign]
    small = torch.randn(BUCKETS[-1], 40)
    _close(layer(small), F.linear(small, w, b), 40)
    assert calls == [small.shape]
    for x in (
        torch.randn(BUCKETS[-1] + 1, 40),  # past the last bucket
        torch.randn(40, 8).t(),  # inner stride 8
        torch.randn(2, 3, 40),  # not 2-D
        torch.randn(0, 40),  # no rows
    ):
        assert torch.equal(layer(x), F.linear(x, w, b))
    assert calls == [small.shape]


def test_calibration_decides_per_bucket_and_caches(tmp_path, monkeypatch):
    """A layer measures a bucket once, on first use (a real timing of both sides); the
    decision is written to the kernel library's calibration file and read back by a new
    layer of the same shape without measuring."""
    kernel = build.load_kernel()  # the cached library; its calibration file goes to tmp_path
    monkeypatch.setenv("BATCHJOB_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_linear.calib, "_CALIBRATIONS", {})
    w = torch.randn(96, 64)
    measured = []
    real = cpu_linear.measure

    def spy(cls, layer, kn):
        d = real(cls, layer, kn)
        measured.append((cls.rows, d))
        return d

    monkeypatch.setattr(cpu_linear, "measure", spy)
    layer = PackedLinear(w, None, kernel, calibrate=True)
    x = torch.randn(10, 64)
    for _ in range(3):
        _close(layer(x), F.linear(x, w), 64)
    assert [r for r, _ in measured] == [16]  # rows 10: bucket 16, measured once
    d = measured[0][1]
    assert d.kernel_ms > 0 and d.torch_ms > 0
    layer(torch.randn(100, 64))
    assert [r for r, _ in measured] == [16, 128]
    monkeypatch.setattr(cpu_linear.calib, "_CALIBRATIONS", {})  # a new process
    again = PackedLinear(w, None, kernel, calibrate=True)
    again(x)
    assert len(measured) == 2  # read from the file
    assert again._picks == {16: d.use_kernel}
    assert list(tmp_path.glob("*.calibration.json"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_linear")
    tied = make_tiny_model(root / "tied", family="llama", vocab_size=280, layers=2, seed=3)
    return tied


def test_model_swap_packs_each_linear_once_and_keeps_logits(tiny, monkeypatch):
    """``engine.linear = "auto"`` on a float32 CPU model: every projection of every layer a
    PackedLinear and the logits projection one more (the head's weight packed once, not also
    as the lm_head module), with logits equal to torch's within fp32 rounding; ``"torch"``:
    none."""
    monkeypatch.setenv("BATCHJOB_CPU_CALIBRATE", "0")  # the kernel takes every small batch
    fast, info = load_model(tiny, dtype="float32", device="cpu", linear="auto")
    plain, _ = load_model(tiny, dtype="float32", device="cpu", linear="torch")
    packed = [m for m in fast.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * info.config.num_layers + 1
    assert fast.logits_linear is not None and fast.logits_linear.weight is fast.logits_weight()
    assert not any(isinstance(m, nn.Linear) for m in fast.layers.modules())
    if onednn_available(torch.float32):  # oneDNN's copy serves what the kernel does not
        assert all(m.weight is None for m in packed if m is not fast.logits_linear)
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    assert plain.logits_linear is None
    ids = [5, 17, 99, 3, 250, 41, 8]
    _close(_logits(fast, info, ids), _logits(plain, info, ids), info.config.hidden_size)


def test_model_swap_skipped_when_packed_weights_would_not_fit(tiny, monkeypatch):
    monkeypatch.setattr(packed_weights, "mem_available", lambda: 1 << 20)  # 1 MiB available
    model, _ = load_model(tiny, dtype="float32", device="cpu", linear="auto")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert use_cpu_linear(model) == 0


def test_engine_linear_setting_is_validated():
    assert EngineConfig(linear="torch").linear == "torch"
    with pytest.raises(ConfigError, match=r"engine\.linear"):
        EngineConfig(linear="mkl")


def test_calibration_at_load_within_a_budget_then_by_rule(tmp_path, monkeypatch):
    """``calibrate_at_load``: one measurement per (shape, bucket) class however many layers
    share it, smallest buckets first; a spent budget leaves the rest to the rule (kernel up to
    RULE_ROWS rows) and a later load measures them."""
    kernel = build.load_kernel()
    monkeypatch.setenv("BATCHJOB_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_linear.calib, "_CALIBRATIONS", {})
    measured = []

    def fake_measure(cls, layer, kn):
        measured.append(cls.rows)
        return cpu_linear.calib.Decision(True, 1.0, 2.0)

    monkeypatch.setattr(cpu_linear, "measure", fake_measure)
    w = torch.randn(48, 32)
    layers = [PackedLinear(w, None, kernel, calibrate=True) for _ in range(3)]
    assert cpu_linear.calibrate_at_load(layers, budget_s=0.0) == 0  # nothing measured
    want = {b: b <= cpu_linear.RULE_ROWS for b in cpu_linear.BUCKETS}
    assert all(layer._picks == want for layer in layers) and measured == []
    again = [PackedLinear(w, None, kernel, calibrate=True) for _ in range(3)]
    assert cpu_linear.calibrate_at_load(again, budget_s=60.0) == len(cpu_linear.BUCKETS)
    assert measured == list(cpu_linear.BUCKETS)  # once per class, smallest first
    assert all(all(layer._picks.values()) for layer in again)  # kernel 1 ms < torch 2 ms
    x = torch.randn(5, 32)
    _close(again[0](x), F.linear(x, w), 32)
    assert len(measured) == len(cpu_linear.BUCKETS)  # no measurement in the forward


needs_onednn = pytest.mark.skipif(
    not onednn_available(torch.float32), reason="no oneDNN float32 matmul in this torch build"
)


@needs_onednn
def test_onednn_torch_side_matches_torch_linear_and_routes_as_the_kernel_side():
    """With oneDNN's packed copy the torch side (past the last bucket, strided rows, 3-D
    inputs, buckets the kernel does not take) equals F.linear within fp32 rounding; the
    kernel still takes the buckets it was picked for."""
    kernel = build.load_kernel()
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(70, 48, generator=g), torch.randn(70, generator=g)
    layer = PackedLinear(w, b, kernel, calibrate=False, onednn=True)
    assert layer.onednn is not None
    for x in (
        torch.randn(BUCKETS[-1] + 3, 48, generator=g),
        torch.randn(48, 9, generator=g).t(),  # inner stride 9
        torch.randn(2, 5, 48, generator=g),
        torch.randn(7, 96, generator=g)[:, :48],  # row stride 96
    ):
        _close(layer.forward_torch(x), F.linear(x, w, b), 48)
        _close(layer(x), F.linear(x, w, b), 48)
    assert layer(torch.randn(0, 48)).shape == (0, 70)
    small = torch.randn(12, 48, generator=g)
    layer._picks = dict.fromkeys(BUCKETS, False)  # every bucket to the torch side
    _close(layer(small), F.linear(small, w, b), 48)
    assert layer.drop_unused_kernel_copy() and layer.packed is None
    _close(layer(small), F.linear(small, w, b), 48)  # no kernel copy: never picked again


@needs_onednn
def test_kernel_copy_kept_while_a_bucket_picks_it():
    kernel = build.load_kernel()
    layer = PackedLinear(torch.randn(40, 32), None, kernel, calibrate=False, onednn=True)
    layer._picks = {bk: bk <= 64 for bk in BUCKETS}
    assert not layer.drop_unused_kernel_copy() and layer.packed is not None
    plain = PackedLinear(torch.randn(40, 32), None, kernel, calibrate=False)
    plain._picks = dict.fromkeys(BUCKETS, False)
    assert not plain.drop_unused_kernel_copy()  # F.linear as the torch side: keep the kernel


@needs_onednn
def test_calibration_class_names_the_side_the_kernel_was_measured_against():
    kernel = build.load_kernel()
    w = torch.randn(40, 32)
    with_onednn = PackedLinear(w, None, kernel, calibrate=True, onednn=True).linear_class(16)
    without = PackedLinear(w, None, kernel, calibrate=True).linear_class(16)
    assert "/onednn-" in with_onednn.key and "/torch-" in without.key


@needs_onednn
def test_model_swap_with_room_for_one_copy_runs_onednn(tiny, monkeypatch):
    """Room for one packed copy of the float32 weights but not two: oneDNN's copy (faster
    than F.linear at every row count) for every layer and the tied head, logits equal."""
    from batchjob.backends.native.models.onednn_linear import OneDnnLinear

    plain, info = load_model(tiny, dtype="float32", device="cpu", linear="torch")
    need = sum(m.weight.numel() * 4 for m in plain.modules() if isinstance(m, nn.Linear))
    need += plain.logits_weight().numel() * 4
    room = int(1.5 * need / packed_weights.MAX_MEMORY_SHARE)  # one copy fits, two do not
    monkeypatch.setattr(packed_weights, "mem_available", lambda: room)
    model, _ = load_model(tiny, dtype="float32", device="cpu", linear="auto")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    swapped = [m for m in model.modules() if isinstance(m, OneDnnLinear)]
    assert len(swapped) == 4 * info.config.num_layers + 1
    ids = [5, 17, 99, 3, 250, 41, 8]
    _close(_logits(model, info, ids), _logits(plain, info, ids), info.config.hidden_size)
